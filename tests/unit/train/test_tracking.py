"""The MLflow store a run uses: a relative local store is made absolute on the driver, so Ray workers (which run
in other directories) open the same store (a relative one gave them an empty store: 'Run ... not found')."""

from pretrain.train.tracking import tracking_uri


def test_relative_stores_are_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for given, want in [
        ("", f"sqlite:///{tmp_path / 'mlflow.db'}"),
        ("sqlite:///sub/m.db", f"sqlite:///{tmp_path / 'sub' / 'm.db'}"),
        ("sqlite:////abs/m.db", "sqlite:////abs/m.db"),
        ("mlruns", str(tmp_path / "mlruns")),
        ("http://127.0.0.1:5000", "http://127.0.0.1:5000"),
    ]:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", given)
        assert tracking_uri() == want, given
