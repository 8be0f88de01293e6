"""A run whose creation fails after its MLflow run exists (the tokenizer, the vocabulary check, an interrupt, a stop)
ends FAILED or KILLED in MLflow, never left RUNNING (a real sqlite store)."""

from __future__ import annotations

import signal

import pytest
from mlflow import MlflowClient

from pretrain.config import ConfigError, load_config
from pretrain.driver.prepare import create_run
from pretrain.driver.signals import StopNow
from pretrain.train import tracking


@pytest.mark.parametrize(
    ("error", "status", "signame"),
    [
        (ConfigError("model.vocab_size: too small"), "FAILED", None),
        (KeyboardInterrupt(), "KILLED", "SIGINT"),
        (StopNow(signal.SIGTERM, "SIGTERM: stopped at once"), "KILLED", "SIGTERM"),
    ],
)
def test_a_failed_creation_ends_the_mlflow_run(tmp_path, monkeypatch, error, status, signame):
    """An error ends the run FAILED; a stop KILLED, with the signal recorded."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    cfg = load_config(None, [f"checkpoint.dir={tmp_path / 'checkpoints'}"])

    def complete(run_dir):
        raise error

    with pytest.raises(type(error)):
        create_run(cfg, complete=complete)
    (run,) = tracking.list_runs(uri)
    run = MlflowClient(uri).get_run(run.info.run_id)
    assert run.info.status == status
    assert run.data.tags.get("pretrain.stop.signal") == signame


def test_the_runs_params_are_its_config_as_given_and_what_it_resolved(tmp_path, monkeypatch):
    """Params are immutable in MLflow: the config as given (what the run was asked to train; what ``bench --reuse``
    matches), and each value its creation settled (``complete``: the vocabulary, the tokenizer, the budget's steps)
    as ``resolved.<key>``; both configs are artifacts."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    cfg = load_config(None, [f"checkpoint.dir={tmp_path / 'checkpoints'}"])
    given = (str(cfg.model.vocab_size), cfg.data.tokenizer, str(cfg.train.max_steps))

    def complete(run_dir):
        cfg.model.vocab_size, cfg.data.tokenizer, cfg.train.max_steps = 4096, str(run_dir / "tokenizer"), 77

    run_id, run_dir, _ = create_run(cfg, complete=complete)
    client = MlflowClient(uri)
    params = client.get_run(run_id).data.params
    keys = ("model.vocab_size", "data.tokenizer", "train.max_steps")
    assert tuple(params[k] for k in keys) == given
    assert {k: v for k, v in params.items() if k.startswith("resolved.")} == {
        "resolved.model.vocab_size": "4096",
        "resolved.data.tokenizer": str(run_dir / "tokenizer"),
        "resolved.train.max_steps": "77",
    }
    resolved = client.download_artifacts(run_id, "config/resolved.yaml", str(tmp_path))
    assert "vocab_size: 4096" in open(resolved).read()


def test_a_model_smaller_than_the_given_tokenizer_is_refused_before_the_run_exists(tokenizer_dir, workdir):
    """With ``data.tokenizer`` (or token shards) the tokenizer's size is known before the run is created: a smaller
    ``model.vocab_size`` is refused by the driver's checks (``train --dry-run`` too), not after a FAILED run."""
    from pretrain.config.paths import resolve_paths
    from pretrain.data.shards.compat import tokenizer_vocab_size
    from pretrain.driver.prepare import preflight
    from tests.conftest import corpus_lines

    corpus = workdir / "c.txt"
    corpus.write_text("\n".join(corpus_lines(400)) + "\n")
    base = [f"data.sources=[{{path: {corpus}}}]", f"data.tokenizer={tokenizer_dir}", "cluster.use_ray=false"]
    size = tokenizer_vocab_size(tokenizer_dir)
    with pytest.raises(ConfigError) as e:
        preflight(resolve_paths(load_config(None, [*base, "model.vocab_size=300"])), probe=False)
    assert str(e.value) == (
        f"model.vocab_size: 300 is smaller than the tokenizer ({size:,} tokens, {tokenizer_dir}); set 0 to take the "
        "tokenizer's size"
    )
    preflight(resolve_paths(load_config(None, [*base, f"model.vocab_size={size}"])), probe=False)
    assert not (workdir / "mlflow.db").exists() and not (workdir / "checkpoints").exists()


def test_an_encoder_given_a_tokenizer_without_a_mask_token_is_refused_before_the_run_exists(tokenizer_dir, workdir):
    """A masked LM needs the mask token: a given tokenizer without one (a GPT-2 style tokenizer) is one line naming
    ``data.tokenizer`` before anything is created, not a worker's error in a FAILED run."""
    import json
    import shutil

    from pretrain.config.paths import resolve_paths
    from pretrain.driver.prepare import preflight
    from tests.conftest import corpus_lines

    no_mask = workdir / "no-mask"
    shutil.copytree(tokenizer_dir, no_mask)
    config = json.loads((no_mask / "tokenizer_config.json").read_text())
    config.pop("mask_token", None)
    (no_mask / "tokenizer_config.json").write_text(json.dumps(config))
    special = no_mask / "special_tokens_map.json"
    if special.exists():
        special.write_text(json.dumps({k: v for k, v in json.loads(special.read_text()).items() if k != "mask_token"}))
    corpus = workdir / "c.txt"
    corpus.write_text("\n".join(corpus_lines(400)) + "\n")
    base = [f"data.sources=[{{path: {corpus}}}]", "cluster.use_ray=false", "model.kind=encoder"]
    with pytest.raises(ConfigError) as e:
        preflight(resolve_paths(load_config(None, [*base, f"data.tokenizer={no_mask}"])), probe=False)
    assert str(e.value).startswith(f"data.tokenizer: {no_mask} has no mask token, which a masked LM")
    preflight(resolve_paths(load_config(None, [*base, f"data.tokenizer={tokenizer_dir}"])), probe=False)
    assert not (workdir / "mlflow.db").exists() and not (workdir / "checkpoints").exists()


def test_a_growth_that_cannot_apply_is_refused_before_the_run_exists(workdir):
    """``preflight`` applies each ``growth.schedule`` entry to a weightless model: a growth that would fail at its
    step is refused in one line before an MLflow run or a run directory exists (``train --dry-run`` too)."""
    from pretrain.config.paths import resolve_paths
    from pretrain.driver.prepare import preflight

    cfg = load_config(None, ["cluster.use_ray=false", "growth.schedule=[{at_step: 10, width: 1.5x}]"])
    with pytest.raises(ConfigError, match=r"^growth\.schedule\[0\]: width_op tile needs integer factors"):
        preflight(resolve_paths(cfg), probe=False)
    assert not (workdir / "mlflow.db").exists() and not (workdir / "checkpoints").exists()


def test_a_stop_after_the_run_exists_and_before_it_runs_ends_it_killed(tokenizer_dir, workdir, monkeypatch):
    """Between the end of the run's creation and the code that runs it no handler is in place: a stop there still
    ends the run ``KILLED`` (the run's hold does, on the command's way out), and a run its runner ended (a failed
    job: ``FAILED``) is left as its runner ended it."""
    import cluster.launch
    from pretrain.driver.prepare import prepare_new
    from pretrain.driver.run_job import run_job
    from tests.conftest import corpus_lines

    corpus = workdir / "c.txt"
    corpus.write_text("\n".join(corpus_lines(400)) + "\n")
    cfg = load_config(None, [f"data.sources=[{{path: {corpus}}}]", f"data.tokenizer={tokenizer_dir}"])
    created = []

    def stopped_on_the_way(held):
        job = prepare_new(cfg, hold=held)
        created.append(job.run_id)
        raise StopNow(signal.SIGTERM, "SIGTERM: stopped at once")  # as a signal raises it, after the creation

    with pytest.raises(StopNow):
        run_job(stopped_on_the_way, lambda job: "run")

    def failing(job, cluster):
        raise RuntimeError("a worker died")

    monkeypatch.setattr(cluster.launch, "run", failing)
    with pytest.raises(RuntimeError):
        run_job(lambda held: (prepare_new(cfg, hold=held), False), lambda job: "run")
    uri = tracking.tracking_uri()
    runs = {r.info.run_id: MlflowClient(uri).get_run(r.info.run_id) for r in tracking.list_runs(uri)}
    killed = runs.pop(created[0])
    assert killed.info.status == "KILLED" and killed.data.tags.get("pretrain.stop.signal") == "SIGTERM"
    ((failed),) = runs.values()
    assert failed.info.status == "FAILED" and "pretrain.stop.signal" not in failed.data.tags
