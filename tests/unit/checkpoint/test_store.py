"""The checkpoint layer on its own: the commit protocol (staging, manifest, checksums, discovery), the typed manifest
(old manifests parse), the collective writer in a world of one (full weights and optimizer moments round-trip) and
the reader. A process killed mid-commit and the resume of full weights on a gloo rank are in
``tests/integration/checkpoint/test_checkpoint.py``."""

from __future__ import annotations

import json
import os

import pytest
import torch

from pretrain.checkpoint import layout as ly
from pretrain.checkpoint import reader, weights
from pretrain.checkpoint import store as ck
from pretrain.checkpoint.manifest import FORMAT_DEEPSPEED, FORMAT_FULL, Manifest
from pretrain.checkpoint.writer import CheckpointWriter, Contents, FullWeights, LocalWorld
from tests.conftest import FIXTURES
from tests.harness import tiny_model


def _stage(run_dir, step, world=2, nonce="n1"):
    stage = ly.staging_dir(run_dir, step, nonce)
    (stage / ly.DS_DIR / ly.DS_TAG).mkdir(parents=True)
    (stage / ly.DS_DIR / ly.DS_TAG / "model.pt").write_bytes(os.urandom(1000))
    for r in range(world):
        ck.write_json(stage / ly.data_file(r), {"streams": {str(r): {"pos": step}}})
        (stage / ly.rng_file(r)).parent.mkdir(exist_ok=True)
        torch.save({"torch": torch.get_rng_state()}, stage / ly.rng_file(r))
    return stage


def _commit(run_dir, step, world=2, **fields):
    return ck.commit(_stage(run_dir, step, world), run_dir, Manifest(step=step, world_size=2, **fields))


def test_commit_list_resolve_verify(tmp_path):
    for step in (2, 4):
        _commit(tmp_path, step, tokens_seen=step * 10)
    found = ck.list_committed(tmp_path)
    assert [c.step for c in found] == [2, 4]
    latest = ck.resolve(tmp_path)
    assert latest.step == 4 and latest.manifest.tokens_seen == 40
    assert set(latest.manifest.files) >= {"data/rank_0.json", "data/rank_1.json", "rng/rank_0.pt"}
    merged, rng = reader.load_rank_state(latest.path, 1)
    assert merged["streams"] == {"0": {"pos": 4}, "1": {"pos": 4}}
    assert torch.equal(rng["torch"], torch.get_rng_state())


def test_uncommitted_staging_is_invisible_and_cleaned(tmp_path):
    _commit(tmp_path, 2)
    _stage(tmp_path, 4, nonce="crashed")  # a save that died before commit
    assert ck.latest_committed(tmp_path).step == 2
    ck.cleanup_staging(tmp_path)
    assert not any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())


def test_incomplete_stage_is_refused(tmp_path):
    stage = _stage(tmp_path, 2, world=1)
    with pytest.raises(ck.CheckpointError, match="missing data/rank_1.json"):
        ck.commit(stage, tmp_path, Manifest(step=2, world_size=2))
    assert ck.latest_committed(tmp_path) is None


def test_corruption_is_detected(tmp_path):
    path = _commit(tmp_path, 2)
    with open(path / ly.DS_DIR / ly.DS_TAG / "model.pt", "r+b") as f:
        f.write(b"\0\0\0\0")
    with pytest.raises(ck.CheckpointError, match="checksum mismatch"):
        ck.resolve(path)
    (path / ly.MANIFEST).write_text("{not json")
    assert ck.list_committed(tmp_path) == []


def test_prune_keeps_newest(tmp_path):
    for step in (1, 2, 3):
        _commit(tmp_path, step)
    ck.prune(tmp_path, keep_last=2)
    assert [c.step for c in ck.list_committed(tmp_path)] == [2, 3]


def test_damaged_checkpoint_names_the_newest_that_verifies(tmp_path):
    for step in (2, 4, 6):
        _commit(tmp_path, step)
    for step in (4, 6):  # the two newest are damaged
        with open(tmp_path / ly.step_dir_name(step) / ly.DS_DIR / ly.DS_TAG / "model.pt", "r+b") as f:
            f.write(b"\0\0\0\0")
    with pytest.raises(ck.CheckpointError) as e:
        ck.resolve(tmp_path)
    good = tmp_path / ly.step_dir_name(2)
    assert str(e.value) == (
        f"{tmp_path / ly.step_dir_name(6)}: checksum mismatch for {ly.DS_DIR}/{ly.DS_TAG}/model.pt; "
        f"the newest checkpoint that verifies is step 2: resume from it with "
        f"./launch.sh resume {good}"
    )
    assert ck.resolve(good).step == 2  # what that command resolves
    (good / ly.DS_DIR / ly.DS_TAG / "model.pt").unlink()
    with pytest.raises(ck.CheckpointError, match="no older checkpoint of this run verifies"):
        ck.resolve(tmp_path)


FIXTURE = FIXTURES / "old_checkpoint" / "step_00000002"


def test_old_manifest_parses_and_round_trips():
    """A manifest written before the typed schema (the fixture's): every field read, the format is DeepSpeed engine
    state, and nothing is lost when it is written back."""
    raw = json.loads((FIXTURE / ly.MANIFEST).read_text())
    assert "format" not in raw
    m = ck.read_manifest(FIXTURE)
    assert (m.step, m.world_size, m.format, m.global_sequences) == (2, 1, FORMAT_DEEPSPEED, 16)
    assert m.files[ly.data_file(0)].bytes == (FIXTURE / ly.data_file(0)).stat().st_size
    assert {k: v for k, v in m.to_dict().items() if k != "format"} == raw
    ck.verify(FIXTURE, m)
    assert Manifest.from_dict({**raw, "future_key": 1}).to_dict()["future_key"] == 1
    with pytest.raises(ValueError, match="unknown checkpoint format 'zip'"):
        Manifest.from_dict({**raw, "format": "zip"})


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


def test_writer_failure_is_one_error_and_nothing_committed(tmp_path):
    (tmp_path / "tok").mkdir()

    def register(path, manifest):
        raise OSError("tracking store down")

    writer = CheckpointWriter(tmp_path / "run", LocalWorld(), "r", register=register)
    with pytest.raises(ck.CheckpointError, match=r"^checkpoint at step 3 failed: OSError: tracking store down$"):
        writer.save(_contents(tmp_path / "tok"))
    staged = writer.stage(4)
    with pytest.raises(ck.CheckpointError, match=rf"incomplete checkpoint, missing {ly.data_file(0)}, {ly.WEIGHTS}"):
        writer.commit(staged, Manifest(step=4, format=FORMAT_FULL))
