"""Checkpoints of an older layout still work: ``tests/fixtures/old_checkpoint/step_00000002`` was written by an
older version (see the README there) and is kept unchanged. It exports with a passing parity check; its bitwise
resume is in ``tests/integration/checkpoint/test_compat.py``. How export and eval find a checkpoint in a run
directory, a damaged one refused naming the one to take instead."""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.conftest import FIXTURES

OLD = FIXTURES / "old_checkpoint" / "step_00000002"


def test_old_checkpoint_exports(tmp_path):
    from pretrain.checkpoint import reader
    from pretrain.export.hf import export_checkpoint

    ckpt = shutil.copytree(OLD, tmp_path / "run" / OLD.name)
    report = export_checkpoint(str(ckpt), tmp_path / "hf", log=lambda *a: None)
    assert report.hf_class == "LlamaForCausalLM" and report.max_abs_diff < 1e-4
    loaded = reader.load(reader.find_checkpoint(ckpt))
    assert loaded.trainer_state()["step"] == 2 and loaded.trainer_state()["sequences"] == 16
    assert sum(s["sequences"] for s in loaded.data_position()["streams"].values()) == 16


def _two_checkpoints(tmp_path):
    """A run directory with the checkpoints of steps 1 and 2."""
    from pretrain.checkpoint.writer import CheckpointWriter, Contents, FullWeights, LocalWorld
    from pretrain.config import load_config

    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    cfg = load_config(None, [f"data.tokenizer={tmp_path / 'tok'}"])
    writer = CheckpointWriter(tmp_path / "run", LocalWorld(), "r")
    for step in (1, 2):
        writer.save(Contents(cfg, {"step": step}, {}, FullWeights({"a": torch.zeros(2)})))
    return tmp_path / "run"


def test_a_damaged_checkpoint_is_refused_naming_the_one_to_take_instead_without_resume_advice(tmp_path):
    """Export and eval find a checkpoint by run directory, ``--step`` or not: a damaged one names the newest older
    checkpoint that verifies, as the directory to give the same command (no ``resume``); an unreadable manifest of
    the step asked for is said to be one, not taken for a missing step."""
    from pretrain.checkpoint import reader
    from pretrain.checkpoint.store import CheckpointError
    from pretrain.config import ConfigError

    run = _two_checkpoints(tmp_path)
    (run / "step_00000002" / "data" / "rank_0.json").write_text("[]")  # same size, other bytes
    instead = f"; the newest checkpoint that verifies is step 1: {run / 'step_00000001'}"
    for step in (None, 2):
        with pytest.raises(CheckpointError) as e:
            reader.find_checkpoint(run, step)
        assert str(e.value) == f"{run / 'step_00000002'}: checksum mismatch for data/rank_0.json{instead}"
    (run / "step_00000002" / "manifest.json").write_text("{")
    with pytest.raises(CheckpointError, match=r"step_00000002/manifest.json: corrupt manifest \(") as e:
        reader.find_checkpoint(run, 2)
    assert str(e.value).endswith(instead)
    with pytest.raises(ConfigError, match=r"^--step 3: no committed checkpoint of that step in .* \(committed: 1\)$"):
        reader.find_checkpoint(run, 3)
    assert reader.find_checkpoint(run, 1).step == 1


def test_a_checkpoint_of_a_scheduled_rho_run_is_scaled_by_the_rate_it_was_trained_under(tmp_path, tokenizer_dir):
    """``rho`` scaling with a ``progressive`` schedule that has not reached its rate: eval, export and generate of a
    checkpoint fold the keep probabilities of its last step (what its run validated at that step), not the final
    rate's; pruning it folds the same."""
    from pretrain.driver.prune import pruned
    from pretrain.export.checkpoints import resolve_checkpoint
    from pretrain.model.layerdrop import fold_branch_scales, inference_scales
    from tests.unit.export.test_hf import perturbed_state, small_run_config, write_checkpoint

    drop = ["layer_drop.rate=0.5", "layer_drop.scaling=rho", "layer_drop.schedule=progressive", "layer_drop.gamma=0.1"]
    cfg = small_run_config(tmp_path, tokenizer_dir, drop)
    sd = perturbed_state(cfg.model)
    ckpt = write_checkpoint(tmp_path / "run", cfg, sd, tokenizer_dir, step=3)
    loaded = resolve_checkpoint(str(ckpt))
    layers, placement = cfg.model.num_layers, cfg.model.norm_placement
    trained = inference_scales(cfg.layer_drop, layers, step=2)  # after 3 steps: rate 0.5 (1 - e^-0.2) ~ 0.09
    assert trained != inference_scales(cfg.layer_drop, layers)
    expected = fold_branch_scales(sd, placement, trained)
    assert all(torch.equal(loaded.state_dict()[k], expected[k]) for k in expected)
    child_cfg, child = pruned(loaded, list(range(layers)))  # every block kept: the parent's inference forward
    assert child_cfg.layer_drop.scaling == "inverted" and all(torch.equal(child[k], expected[k]) for k in expected)


def test_a_checkpoint_no_conversion_can_load_is_a_bad_checkpoint_no_restart_passes(tmp_path, tokenizer_dir):
    """Converting to the full form (another expert layout, tensor parallelism) needs ZeRO-1/2 state: a ZeRO-0 or
    ZeRO-3 checkpoint is refused as a :class:`BadCheckpoint`, which Ray Train's restarts leave alone."""
    from cluster.failures import is_final
    from pretrain.checkpoint import reader
    from pretrain.checkpoint.store import BadCheckpoint, open_committed
    from tests.unit.cluster.test_failures import _failed
    from tests.unit.export.test_hf import perturbed_state, small_run_config, write_checkpoint

    cfg = small_run_config(tmp_path, tokenizer_dir, [])
    ckpt = open_committed(write_checkpoint(tmp_path / "run", cfg, perturbed_state(cfg.model), tokenizer_dir, 2))
    with pytest.raises(BadCheckpoint, match=r"needs a ZeRO-1/2 checkpoint \(this one: ZeRO-0\)") as e:
        reader.resharded_full_form(ckpt, tmp_path / "cache")
    assert is_final(_failed(e.value))
