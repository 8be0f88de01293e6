"""Which earlier runs a study may reuse (``benchmarks/reuse.py``): the config match and the stores a path names."""

from __future__ import annotations

import pytest

from benchmarks.reuse import PARAM_CHARS, same_config, stores
from pretrain.config import ConfigError

WANT = {"model.num_layers": 4, "train.lr": 0.002, "train.seed": 0, "data.sources": "[1, 2]", "data.tokenizer": ""}


def _logged(want: dict) -> dict[str, str]:
    return {k: str(v)[:PARAM_CHARS] for k, v in want.items()}


def test_the_same_config_matches_whatever_its_locations():
    assert same_config(WANT, _logged(WANT))
    moved = {**WANT, "checkpoint.dir": "/a", "tracking.run_name": "x", "data.cache_dir": "/c"}
    assert same_config(moved, {**_logged(WANT), "checkpoint.dir": "/b", "data.cache_dir": "/d"}), "where, not what"
    assert not same_config({**WANT, "train.seed": 1}, _logged(WANT)), "another seed"
    assert not same_config({**WANT, "train.lr": 0.001}, _logged(WANT))
    assert not same_config({**WANT, "model.z_loss": 0.0}, _logged(WANT)), "a key the run never logged"
    long = {**WANT, "data.sources": "x" * (PARAM_CHARS + 10)}
    assert same_config(long, _logged(long)), "MLflow keeps the first 6000 characters"


def test_a_field_added_since_the_run_matches_only_at_its_default():
    defaults = {"faults.slow_run_creation_s": 0.0, "train.lr": 0.0004}
    added = {**WANT, "faults.slow_run_creation_s": 0.0}
    assert same_config(added, _logged(WANT), defaults), "the run predates the field; the default keeps its code"
    assert not same_config({**WANT, "faults.slow_run_creation_s": 1.0}, _logged(WANT), defaults), "not the default"
    assert not same_config(added, _logged(WANT)), "without the defaults: a key the run never logged"
    logged_other = {**_logged(WANT), "faults.slow_run_creation_s": "2.0"}
    assert not same_config(added, logged_other, defaults), "a logged value is compared as it is"


def test_the_tokenizer_matches_by_content(tmp_path):
    for name, text in (("a", '{"v": 1}'), ("b", '{"v": 1}'), ("c", '{"v": 2}')):
        (tmp_path / name).mkdir()
        (tmp_path / name / "tokenizer.json").write_text(text)
    want = {**WANT, "data.tokenizer": str(tmp_path / "a")}
    assert same_config(want, {**_logged(WANT), "data.tokenizer": str(tmp_path / "b")}), "a copy of it"
    assert same_config(want, {**_logged(WANT), "data.tokenizer": str(tmp_path / "b" / "tokenizer.json")})
    assert not same_config(want, {**_logged(WANT), "data.tokenizer": str(tmp_path / "c")}), "another tokenizer"
    assert not same_config(want, {**_logged(WANT), "data.tokenizer": str(tmp_path / "gone")})
    assert not same_config(want, _logged(WANT)), "one run trained its tokenizer, the other was given one"


def test_stores_under_a_path(tmp_path):
    for d in ("s0/bench-growth/1", "s0/bench-growth/2"):
        (tmp_path / d).mkdir(parents=True)
        (tmp_path / d / "mlflow.db").write_bytes(b"")
    found = stores([tmp_path / "s0", tmp_path / "s0/bench-growth/1/mlflow.db"])
    assert [p.parent.name for p in found] == ["1", "2"], "each store once"
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"--reuse .*empty: no MLflow store"):
        stores([tmp_path / "empty"])


def test_find_matches_a_finished_run_by_config_whatever_its_name(tmp_path):
    """A real MLflow store: the layer-dropout study's ``no-drop`` run is found as the growth study's ``scratch``."""
    from mlflow import MlflowClient

    from benchmarks.reuse import find

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("bench-growth")

    def logged(name: str, want: dict, last_step: int, status: str = "FINISHED") -> str:
        run = client.create_run(exp, run_name=name).info.run_id
        for key, value in _logged(want).items():
            client.log_param(run, key, value)
        client.log_metric(run, "train/loss", 3.0, step=last_step)
        client.set_terminated(run, status)
        return run

    logged("stopped seed 0", WANT, 8, status="KILLED")
    logged("short seed 0", WANT, 7)
    logged("other seed", {**WANT, "train.seed": 1}, 8)
    scratch = logged("scratch seed 0", WANT, 8)
    logged("later scratch seed 0", WANT, 8)
    hit = find([uri], WANT, 8)
    assert hit is not None and hit[0] == uri and hit[1].info.run_id == scratch, "the earliest finished full run"
    assert find([uri], {**WANT, "train.seed": 2}, 8) is None
    assert find([uri], WANT, 9) is None, "no run reached step 9"


def test_a_study_reads_a_reused_model_from_its_checkpoints_only_while_they_exist(tmp_path):
    """``Study.train(..., checkpoint=True)`` (the layer-dropout study prunes and evaluates the run): a matching run
    whose checkpoint directory is gone is trained again; one whose directory exists is read from it, and its metrics
    from the store that holds it."""
    import copy

    from mlflow import MlflowClient

    from benchmarks.early_exit_study import _history
    from benchmarks.study import ROOT, Study
    from pretrain.config import flatten, to_dict
    from pretrain.config.paths import resolve_paths
    from pretrain.driver.budget import resolve_budget

    uri = f"sqlite:///{tmp_path / 'earlier.db'}"
    client = MlflowClient(tracking_uri=uri)
    study = Study(
        "s", ROOT / "configs" / "demo-decoder.yaml", ["train.max_steps=8"], tmp_path, (tmp_path / "earlier.db",)
    )
    cfg = study.config(["tracking.run_name=no-drop seed 0"])
    want = resolve_budget(resolve_paths(copy.deepcopy(cfg)), say=lambda _line: None)
    run = client.create_run(client.create_experiment("bench-growth"), run_name="scratch seed 0").info.run_id
    for key, value in flatten(to_dict(want)).items():
        client.log_param(run, key, str(value)[:PARAM_CHARS])
    client.log_metric(run, "train/loss", 3.0, step=8)
    root = tmp_path / "checkpoints" / run
    client.set_tag(run, "pretrain.checkpoint_root", str(root))
    client.set_terminated(run, "FINISHED")
    assert study._earlier("no-drop seed 0", cfg, checkpoint=True) is None, "its checkpoints are gone"
    assert study._earlier("no-drop seed 0", cfg, checkpoint=False).source == run, "curves only: its run id"
    root.mkdir(parents=True)
    found = study._earlier("no-drop seed 0", cfg, checkpoint=True)
    assert found.run_id == run and found.source == str(root) and found.steps == 8
    assert found.tracking_uri == uri != study.uri
    assert _history(study, found, "train/loss") == [(8, 3.0)], "its metrics are read from the store that holds it"
    assert study.reused["no-drop seed 0"] == {"tracking_uri": uri, "run_id": run, "run_name": "scratch seed 0"}
