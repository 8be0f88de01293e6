"""The options of the commands that derive a run from a checkpoint (``prune``, ``grow``, ``anneal``): malformed
values are one line naming the option, before any checkpoint is read (the commands themselves run through the CLI
in ``tests/integration/growth`` and ``tests/integration/train/test_anneal.py``)."""

from __future__ import annotations

import pytest

from pretrain.config import ConfigError
from pretrain.driver.anneal import anneal
from pretrain.driver.derive import parse_options, step_option
from pretrain.driver.grow import grow
from pretrain.driver.prune import prune


def test_options_given_twice_or_unknown_are_named():
    assert parse_options(["RUN", "layers=first:2", "step=4"], {"layers", "step"}, "prune") == {
        "layers": "first:2",
        "step": "4",
    }
    with pytest.raises(ConfigError, match="^prune: layers given more than once$"):
        parse_options(["RUN", "layers=every_other", "layers=first:1"], {"layers"}, "prune")
    with pytest.raises(ConfigError, match=r"^prune: unknown option\(s\) \['depth'\] \(valid: layers\)$"):
        parse_options(["RUN", "depth=2"], {"layers"}, "prune")
    assert step_option({}, "grow") is None and step_option({"step": "12"}, "grow") == 12


@pytest.mark.parametrize(
    ("command", "argv", "message"),
    [
        (prune, ["/no/such", "step=abc"], "prune: step=abc: not a checkpoint step (a whole number)"),
        (grow, ["/no/such", "step=-1"], "grow: step=-1: not a checkpoint step (a whole number)"),
        (anneal, ["/no/such", "steps=4", "step=x"], "anneal: step=x: not a checkpoint step (a whole number)"),
        (grow, ["/no/such", "experts=four"], "grow experts: 'four': expected a whole number"),
        (grow, ["/no/such", "noise=lots"], "grow noise: 'lots': expected a number"),
        (prune, ["/no/such", "step=²"], "prune: step=²: not a checkpoint step (a whole number)"),
        (anneal, ["/no/such", "steps=²"], "anneal: steps=N (the length of the decay, > 0) is required, got '²'"),
        (grow, ["/no/such", "experts=²"], "grow experts: '²': expected a whole number"),
        (grow, ["/no/such", "noise=-1"], "grow: noise and experts must be >= 0"),
        (grow, ["/no/such", "experts=100000"], "grow.experts: 100,000 is more than 4,096"),
        (grow, ["/no/such", "depth=0x"], "grow.depth: '0x' grows nothing (leave the key out instead)"),
    ],
)
def test_malformed_values_are_refused_before_the_checkpoint_is_read(command, argv, message):
    with pytest.raises(ConfigError) as e:
        command(argv)
    assert str(e.value) == message


def test_a_child_whose_first_checkpoint_fails_ends_failed(tmp_path, monkeypatch):
    """The child run exists (MLflow) before its first checkpoint is written: a write that fails ends it FAILED, never
    left RUNNING (a real sqlite store; the old-layout fixture is the parent)."""
    import shutil

    from mlflow import MlflowClient

    from pretrain.checkpoint.store import CheckpointError
    from pretrain.checkpoint.writer import CheckpointWriter
    from pretrain.driver.derive import derive_run, parent_engine_state
    from pretrain.export.checkpoints import resolve_checkpoint
    from pretrain.train import tracking
    from tests.unit.checkpoint.test_reader import OLD

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    parent = resolve_checkpoint(str(shutil.copytree(OLD, tmp_path / "run" / OLD.name)))
    cfg = parent.config
    cfg.checkpoint.dir, cfg.tracking.enabled = str(tmp_path / "children"), True

    def full_disk(self, contents):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(CheckpointWriter, "save", full_disk)
    with pytest.raises(OSError, match="No space left"):
        derive_run(parent, cfg, parent_engine_state(parent), {}, "anneal")
    (run,) = tracking.list_runs(uri)
    assert MlflowClient(uri).get_run(run.info.run_id).info.status == "FAILED"
    # written, but MLflow did not record it: the child has no checkpoint to resume by its id, so it fails too
    monkeypatch.undo()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)

    def down(self, path, manifest):
        raise OSError("tracking store down")

    monkeypatch.setattr(tracking.Tracker, "register_checkpoint", down)
    with pytest.raises(CheckpointError, match=r"step_00000002 committed, but recording it in MLflow failed"):
        derive_run(parent, cfg, parent_engine_state(parent), {}, "anneal")
    statuses = sorted(MlflowClient(uri).get_run(r.info.run_id).info.status for r in tracking.list_runs(uri))
    assert statuses == ["FAILED", "FAILED"]


def test_a_child_keeps_its_parents_data_fingerprint_and_early_exit_plan(tmp_path, monkeypatch):
    """The position is one in the data the parent trained on: the child records that data's fingerprint (a resume of
    the child on data changed since is refused as the parent's would be), not the data as it is when it is made."""
    import json
    import shutil

    from pretrain.driver.derive import derive_run, parent_engine_state
    from pretrain.export.checkpoints import resolve_checkpoint
    from pretrain.train.job import FINGERPRINT_STATE
    from tests.unit.checkpoint.test_reader import OLD

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    parent = resolve_checkpoint(str(shutil.copytree(OLD, tmp_path / "run" / OLD.name)))
    cfg = parent.config
    cfg.checkpoint.dir = str(tmp_path / "children")
    saved = parent.trainer_state()
    parents = {"data.sources[0]": {"path": "corpus.txt", "files": {"corpus.txt": {"size": 1}}}}
    window = {"trained": 7, "steps": 3, "planned_steps": 1000}  # the early-exit curriculum's planned length
    callbacks = {FINGERPRINT_STATE: parents, "early_exit_window": window}
    monkeypatch.setattr(parent, "trainer_state", lambda: {**saved, "callbacks": callbacks})
    _, path = derive_run(parent, cfg, parent_engine_state(parent), {}, "anneal")
    state = json.loads((path / "trainer_state.json").read_text())
    assert state["callbacks"][FINGERPRINT_STATE] == parents
    # the child keeps the parent's plan (a ``gradual`` curriculum planned for the child's own max_steps switched
    # off exits the parent trained), not its window of logged counts
    assert state["callbacks"]["early_exit_window"] == {"trained": 0, "steps": 0, "planned_steps": 1000}


def test_a_growth_beyond_the_size_limits_is_refused_before_any_block_is_copied(tokenizer_dir, workdir):
    """``grow`` checks the sizes it grows to as a ``growth.schedule`` entry is checked: a typo (``depth=100000x``)
    is one line, not a machine out of memory."""
    from tests.unit.export.test_hf import perturbed_state, small_run_config, write_checkpoint

    cfg = small_run_config(workdir, tokenizer_dir, [])
    ckpt = write_checkpoint(workdir / "run", cfg, perturbed_state(cfg.model), tokenizer_dir, 3)
    for target, key in (("depth=100000x", "model.num_layers"), ("width=99999999999999999999x", "model.hidden_size")):
        with pytest.raises(ConfigError, match=rf"^grow\.\w+: .* grows {key} to [\d,]+, more than [\d,]+$"):
            grow([str(ckpt), target])
