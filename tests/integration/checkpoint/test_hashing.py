"""Checksums scale with the ranks (2 real gloo ranks): at save every rank hashes only the files it wrote and rank 0
gathers the digests; at resume every rank hashes its share of the files, each file once in the whole job; the
``verify`` command checks everything on demand (exit 2 naming the first bad file)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch

from pretrain.checkpoint import layout as ly
from pretrain.checkpoint import store
from tests.harness import TINY_MODEL, cli, run_distributed
from tests.unit.checkpoint.test_store import OLD


def tiny_zero2_config(work_dir: Path, *extra: str):
    """A tiny fp32 decoder under ZeRO-2 for 2 ranks (micro-batch 2), with a placeholder tokenizer directory."""
    from pretrain.config import load_config

    tok = work_dir / "tok"
    tok.mkdir(exist_ok=True)
    (tok / "tokenizer.json").write_text("{}")
    return load_config(
        None,
        [
            *TINY_MODEL,
            "zero.stage=2",
            "train.global_batch_size=4",
            "train.micro_batch_size=2",
            "data.num_streams=4",
            "train.lr=1e-2",
            "train.warmup_steps=1",
            "train.precision=fp32",
            f"data.tokenizer={tok}",
            *extra,
        ],
    )


def _writer_rank(rel: str) -> int:
    """Which rank writes ``rel`` (DeepSpeed and our layout name per-rank files by rank; rank 0 writes the rest)."""
    return store.verifying_rank(rel, 1 << 30)


def _save_and_verify(rank: int, world: int, work: str) -> dict:
    """Two ranks save one ZeRO-2 engine checkpoint through the collective writer with the hashing spied on, then
    verify it in parallel as a resume does (intact, then with one byte of rank 1's optimizer partition flipped)."""
    from pretrain.checkpoint.writer import CheckpointWriter, Contents, EngineState
    from pretrain.train import dist
    from pretrain.train.checkpointer import DistWorld
    from pretrain.train.module import build_module
    from pretrain.train.resume import verify_in_parallel
    from pretrain.train.step import StepInput, run_step

    torch.set_num_threads(1)
    work_dir = Path(work)
    cfg = tiny_zero2_config(work_dir)
    module = build_module(cfg)
    ids = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(rank))
    run_step(module, StepInput(1, {"input_ids": ids, "labels": ids}, module.lr_at(0)))

    from pretrain.checkpoint import hashed_write

    hashed: list[str] = []
    real_sha, real_close = store.sha256_file, hashed_write.HashingFile.close

    def spy(path: Path) -> str:  # a file read back and hashed
        hashed.append(str(path))
        return real_sha(path)

    def spy_close(self) -> str:  # a file hashed as it was written (the engine's large files)
        hashed.append(str(self.path))
        return real_close(self)

    store.sha256_file, hashed_write.HashingFile.close = spy, spy_close
    ctx = dist.DistContext(rank, world, rank, world, torch.device("cpu"), False)
    writer = CheckpointWriter(work_dir / "run", DistWorld(ctx), "r")
    final = writer.save(
        Contents(cfg=cfg, trainer_state={"step": 1}, data_state={"rank": rank}, model=EngineState(module.save))
    )
    # paths inside the staging directory (run/<staging>/REL)
    stage_hashed = [Path(*Path(p).relative_to(work_dir / "run").parts[1:]).as_posix() for p in hashed]
    hashed.clear()
    ckpt = store.open_committed(final)
    verify_in_parallel(ckpt, ctx)
    resume_hashed = [Path(p).relative_to(final).as_posix() for p in hashed]
    store.sha256_file, hashed_write.HashingFile.close = real_sha, real_close
    # the gathered digests are the files' own (checked before the corruption below)
    wrong = [
        rel
        for rel, meta in ckpt.manifest.files.items()
        if (meta.bytes, meta.sha256) != (len(b := (final / rel).read_bytes()), hashlib.sha256(b).hexdigest())
    ]
    dist.barrier()
    error = None
    if rank == 1:
        (victim,) = [r for r in ckpt.manifest.files if "zero_pp_rank_1_" in r]
        with open(final / victim, "r+b") as f:
            b = f.read(1)
            f.seek(0)
            f.write(bytes([b[0] ^ 1]))
    dist.barrier()
    try:
        verify_in_parallel(ckpt, ctx)
    except store.CheckpointError as e:
        error = str(e)
    return {"saved": stage_hashed, "resumed": resume_hashed, "path": str(final), "error": error, "wrong": wrong}


def test_each_rank_hashes_only_its_own_files(tmp_path):
    results = run_distributed(_save_and_verify, 2, str(tmp_path), timeout=900, fresh=False)
    final = Path(results[0]["path"])
    on_disk = sorted(p.relative_to(final).as_posix() for p in final.rglob("*") if p.is_file())
    manifest = json.loads((final / ly.MANIFEST).read_text())["files"]
    assert sorted(manifest) == [p for p in on_disk if p != ly.MANIFEST]
    for rank, res in enumerate(results):
        assert res["saved"], rank
        assert all(_writer_rank(rel) == rank for rel in res["saved"]), (rank, res["saved"])
    saved = results[0]["saved"] + results[1]["saved"]
    assert sorted(saved) == sorted(manifest)  # each file hashed once, by the rank that wrote it
    assert any("zero_pp_rank_1_" in rel for rel in results[1]["saved"])
    assert results[0]["wrong"] == [], results[0]["wrong"]  # the gathered digests are the files' own
    # resume: every file hashed exactly once over both ranks, each rank its own per-rank files
    resumed = results[0]["resumed"] + results[1]["resumed"]
    assert sorted(resumed) == sorted(manifest)
    assert any("zero_pp_rank_1_" in rel for rel in results[1]["resumed"])
    # a flipped byte in rank 1's partition: found by rank 1, the same one-line error on both ranks
    (victim,) = [r for r in manifest if "zero_pp_rank_1_" in r]
    assert (
        results[0]["error"]
        == results[1]["error"]
        == (f"{final}: checksum mismatch for {victim}; no older checkpoint of this run verifies")
    )


def test_verify_command(tmp_path):
    ckpt = shutil.copytree(OLD, tmp_path / "run" / OLD.name)
    ok = cli(tmp_path, "verify", str(ckpt), expect=0)
    assert ok.stdout.startswith(f"verify: OK {ckpt} (step 2, "), ok.stdout + ok.stderr
    cli(tmp_path, "verify", str(tmp_path / "run"), expect=0)  # a run directory: its latest checkpoint
    rel = "ds/state/zero_pp_rank_0_mp_rank_00_optim_states.pt"
    with open(ckpt / rel, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))
    bad = cli(tmp_path, "verify", str(ckpt), expect=2)
    assert bad.stderr.strip().splitlines() == [
        f"error: {ckpt}: checksum mismatch for {rel}; no older checkpoint of this run verifies"
    ]


def test_resume_finds_a_flipped_byte_in_the_worker(tmp_path):
    """Same size, other bytes: the driver's presence/size check passes it, the rank that loads the file finds it:
    one line, exit 2, naming the file."""
    ckpt = shutil.copytree(OLD, tmp_path / "old" / OLD.name)
    rel = "rng/rank_0.pt"
    data = bytearray((ckpt / rel).read_bytes())
    data[-1] ^= 0xFF
    (ckpt / rel).write_bytes(bytes(data))
    proc = cli(
        tmp_path,
        "resume",
        str(ckpt),
        "train.max_steps=4",
        f"checkpoint.dir={tmp_path / 'ckpt'}",
        f"data.cache_dir={tmp_path / 'cache'}",
        expect=2,
        timeout=600,
    )
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert errors == [f"error: {ckpt}: checksum mismatch for {rel}; no older checkpoint of this run verifies"], (
        proc.stderr[-3000:]
    )
