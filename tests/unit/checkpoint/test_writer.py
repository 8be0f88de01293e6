"""The collective writer in a world of one (``pretrain/checkpoint/writer.py``): full weights and optimizer moments
round-trip through the reader; a failed write is one error and commits nothing."""

from __future__ import annotations

import os

import pytest
import torch

from pretrain.checkpoint import layout as ly
from pretrain.checkpoint import reader, weights
from pretrain.checkpoint import store as ck
from pretrain.checkpoint.manifest import FORMAT_FULL, Manifest
from pretrain.checkpoint.writer import CheckpointWriter, Contents, FullWeights, LocalWorld
from tests.harness import tiny_model


def _contents(tokenizer_dir, step=3, moments=None):
    from pretrain.config import load_config

    cfg = load_config(
        None,
        [
            *tiny_model(num_layers=1, hidden_size=16, num_heads=2, num_kv_heads=2, vocab_size=64, max_seq_len=8),
            f"data.tokenizer={tokenizer_dir}",
        ],
    )
    a = torch.randn(3, 4)
    weights = {"a.weight": a, "b.bias": torch.randn(5), "tied.weight": a}  # tied weights share one tensor
    state = {"step": step, "tokens_seen": 96, "sequences": 12, "last_train_loss": 2.5, "last_val": {"val/loss": 2.0}}
    return Contents(
        cfg=cfg, trainer_state=state, data_state={"streams": {"0": {"pos": 12}}}, model=FullWeights(weights, moments)
    )


def test_writer_full_weights_round_trip(tmp_path):
    """Derived runs' path: the writer in a world of one, without an engine: full weights and AdamW moments written
    as safetensors, committed (manifest format ``full``), registered once, and read back exactly."""
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    moments = {"step": 7, "exp_avg": {"a.weight": torch.randn(3, 4)}, "exp_avg_sq": {"a.weight": torch.rand(3, 4)}}
    contents = _contents(tmp_path / "tok", moments=moments)
    registered = []
    writer = CheckpointWriter(
        tmp_path / "run",
        LocalWorld(),
        "run-1",
        keep_last=1,
        register=lambda path, manifest: registered.append((path, manifest.step)),
    )
    path = writer.save(contents)
    assert registered == [(path, 3)] and path.name == ly.step_dir_name(3)
    ckpt = ck.resolve(tmp_path / "run")
    m = ckpt.manifest
    assert (m.format, m.run_id, m.tokens_seen, m.global_sequences, m.metrics) == (
        FORMAT_FULL,
        "run-1",
        96,
        12,
        {"train/loss": 2.5, "val/loss": 2.0},
    )
    assert {
        ly.WEIGHTS,
        ly.OPTIMIZER,
        ly.CONFIG,
        ly.TRAINER_STATE,
        ly.data_file(0),
        ly.rng_file(0),
        f"{ly.TOKENIZER}/tokenizer.json",
    } <= set(m.files)
    loaded = reader.load(ckpt)
    sd = loaded.state_dict()
    assert sd.keys() == contents.model.weights.keys()
    assert all(torch.equal(sd[k], contents.model.weights[k]) for k in sd)
    back = weights.load_optimizer_moments(ckpt.path)
    assert back["step"] == 7 and all(
        torch.equal(back[k]["a.weight"], moments[k]["a.weight"]) for k in ("exp_avg", "exp_avg_sq")
    )
    assert loaded.trainer_state()["sequences"] == 12 and loaded.data_position()["streams"] == {"0": {"pos": 12}}
    assert loaded.config.model.hidden_size == 16
    writer.save(_contents(tmp_path / "tok", step=5))  # keep_last=1 prunes step 3
    assert [c.step for c in ck.list_committed(tmp_path / "run")] == [5]
    assert weights.load_optimizer_moments(tmp_path / "run" / ly.step_dir_name(5)) is None


def test_writer_failure_is_one_error_and_nothing_committed(tmp_path, capsys):
    """A save the store cannot take commits nothing. One MLflow does not record (or whose pruning fails) is a
    committed save: it returns its path with a warning (a tracking server's hiccup never ends a run whose checkpoint
    is on disk), and the record is made at the next commit, or at the run's end, once MLflow takes it."""
    (tmp_path / "tok").mkdir()
    down, recorded = [True], []

    def register(path, manifest):
        if down[0]:
            raise OSError("tracking store down")
        recorded.append((path.name, manifest.step))

    writer = CheckpointWriter(tmp_path / "run", LocalWorld(), "r", keep_last=2, register=register)
    for step in (3, 5):
        path = writer.save(_contents(tmp_path / "tok", step=step))
        assert path == tmp_path / "run" / ly.step_dir_name(step)
        writer.settle()
    assert [c.step for c in ck.list_committed(tmp_path / "run")] == [3, 5] and not recorded
    err = capsys.readouterr().err
    assert (
        f"recording {ly.step_dir_name(3)}, {ly.step_dir_name(5)} in MLflow failed (OSError: tracking store down)" in err
    )
    down[0] = False
    writer.save(_contents(tmp_path / "tok", step=7))  # keep_last=2 prunes step 3 first: nothing to record of it
    writer.settle()
    assert recorded == [(ly.step_dir_name(5), 5), (ly.step_dir_name(7), 7)] and writer.record_pending() == []
    assert [c.step for c in ck.list_committed(tmp_path / "run")] == [5, 7]
    down[0] = True
    writer.save(_contents(tmp_path / "tok", step=9))
    down[0] = False
    assert writer.record_pending() == [] and recorded[-1] == (ly.step_dir_name(9), 9)  # the run's end
    # a pruning that fails after the commit: the save stands
    writer.keep_last = 1
    writer._prune = lambda protect: (_ for _ in ()).throw(OSError("listing failed"))
    assert writer.save(_contents(tmp_path / "tok", step=11)).name == ly.step_dir_name(11)
    assert "committed, but pruning older checkpoints failed (OSError: listing failed)" in capsys.readouterr().err
    staged = writer.stage(4)
    with pytest.raises(ck.CheckpointError, match=rf"incomplete checkpoint, missing {ly.data_file(0)}, {ly.WEIGHTS}"):
        writer.commit(staged, Manifest(step=4, format=FORMAT_FULL))


def test_the_manifest_records_the_expert_layout_the_engine_files_were_saved_in():
    """A derived run's copy of its parent's engine files (``anneal``) keeps the parent's expert layout in its
    manifest, whatever ``parallel.expert`` the child's config sets for what it trains next: a resume compares the
    two to re-lay the experts out, and an export reads the files by it."""
    from pretrain.checkpoint.writer import EngineState, describe
    from pretrain.config import load_config

    cfg = load_config(None, ["moe.num_experts=4", "parallel.expert=2", "cluster.num_workers=2"])
    state = {"step": 3}
    copied = Contents(cfg, state, {}, EngineState(lambda d, f: [], moe_ep_size=1))
    assert describe(copied, "child", 2).moe_ep_size == 1
    assert describe(Contents(cfg, state, {}, EngineState(lambda d, f: [])), "run", 2).moe_ep_size == 2
    dense = load_config(None, [])
    assert describe(Contents(dense, state, {}, EngineState(lambda d, f: [], moe_ep_size=1)), "run", 1).moe_ep_size == 0


def test_a_save_the_place_cannot_take_is_not_writable_and_no_restart_passes(tmp_path, monkeypatch):
    """A full disk (or quota), a read-only filesystem, a directory not the run's: the save's error says the place
    cannot take it (:class:`CheckpointNotWritable`, which Ray Train's restarts leave alone: each would train to the
    next save and fail there again); another I/O error stays a plain one, retried. Nothing is committed."""
    import errno

    from cluster.failures import is_final
    from pretrain.checkpoint import weights as ckpt_weights
    from tests.unit.cluster.test_failures import _failed

    (tmp_path / "tok").mkdir()
    writer = CheckpointWriter(tmp_path / "run", LocalWorld(), "r")
    for code, final in ((errno.ENOSPC, True), (errno.EROFS, True), (errno.EACCES, True), (errno.EIO, False)):

        def refused(*args, code=code, **kwargs):
            raise OSError(code, os.strerror(code))

        monkeypatch.setattr(ckpt_weights, "save_full_weights", refused)
        with pytest.raises(ck.CheckpointError, match=rf"^checkpoint at step 3 failed: \w+: \[Errno {code}\]") as e:
            writer.save(_contents(tmp_path / "tok", step=3))
        assert isinstance(e.value, ck.CheckpointNotWritable) == final == is_final(_failed(e.value)), code
        assert ck.list_committed(tmp_path / "run") == []
