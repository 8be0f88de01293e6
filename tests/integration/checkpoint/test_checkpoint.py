"""The checkpoint layer in other processes: a process that dies while committing leaves the last good checkpoint,
and a full-weights checkpoint written by the collective writer resumes weights and optimizer moments on a real
gloo rank (and a rollback restores them in place)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
from pathlib import Path

import torch

from pretrain.checkpoint import layout as ly
from pretrain.checkpoint import store as ck
from pretrain.checkpoint.manifest import FORMAT_FULL, Manifest
from pretrain.checkpoint.writer import CheckpointWriter, Contents, FullWeights, LocalWorld
from tests.harness import TINY_MODEL, run_distributed
from tests.unit.checkpoint.test_store import _commit, _stage


def _die_during_commit(run_dir):
    stage = _stage(run_dir, 6)
    real = ck.write_json

    def boom(path, obj):
        if path.name == ly.MANIFEST:
            os._exit(9)  # the process dies while committing
        real(path, obj)

    ck.write_json = boom
    ck.commit(stage, run_dir, Manifest(step=6, world_size=2))


def test_crash_mid_commit_keeps_last_good(tmp_path):
    _commit(tmp_path, 4, tokens_seen=1)
    p = mp.get_context("spawn").Process(target=_die_during_commit, args=(tmp_path,))
    p.start()
    p.join(60)
    assert p.exitcode == 9
    latest = ck.resolve(tmp_path)
    assert latest.step == 4
    assert json.loads((latest.path / ly.MANIFEST).read_text())["tokens_seen"] == 1


def _full_weights_resume(rank: int, world: int, work: str) -> dict:
    """A module trained 2 steps, saved as full weights + moments by the writer (no engine involved in writing);
    resumed (module built from the weights, moments loaded) and rolled back to (rebuilt in place): the next two
    steps' losses equal the uninterrupted module's bitwise (the second one is after an update, which the moments
    shape: a module built from the weights alone, with fresh moments, differs there)."""
    from pretrain.config import load_config
    from pretrain.train import dist
    from pretrain.train.module import build_module
    from pretrain.train.optimizer_state import gather_moments
    from pretrain.train.resume import load_model_state, resume_source
    from pretrain.train.step import StepInput, run_step

    torch.set_num_threads(1)
    (Path(work) / "tok").mkdir()
    cfg = load_config(
        None,
        [
            *TINY_MODEL,
            "zero.stage=1",
            "train.global_batch_size=4",
            "train.micro_batch_size=4",
            "data.num_streams=4",
            "train.lr=1e-2",
            "train.warmup_steps=1",
            "train.precision=fp32",
            f"data.tokenizer={work}/tok",
        ],
    )
    g = torch.Generator().manual_seed(3)
    data = [torch.randint(0, 101, (4, 16), generator=g) for _ in range(4)]

    def step(module, i):
        return run_step(module, StepInput(i + 1, {"input_ids": data[i], "labels": data[i]}, module.lr_at(i))).loss

    module = build_module(cfg)
    for i in range(2):
        step(module, i)
    writer = CheckpointWriter(Path(work) / "run", LocalWorld(), "r")
    state = {"step": 2, "tokens_seen": 128, "sequences": 8}
    writer.save(
        Contents(
            cfg=cfg,
            trainer_state=state,
            data_state={"streams": {}},
            model=FullWeights(module.full_state_dict(), gather_moments(module)),
        )
    )
    ckpt = ck.resolve(Path(work) / "run")
    ctx = dist.DistContext(0, 1, 0, 1, torch.device("cpu"), False)
    source = resume_source(ckpt, Path(work) / "run", ctx, 0)
    resumed = build_module(cfg, weights=source.weights)
    load_model_state(resumed, source, built=True)
    rolled = build_module(cfg)  # another trajectory, then a rollback to the checkpoint
    step(rolled, 0)
    load_model_state(rolled, source)
    fresh = build_module(cfg, weights=source.weights)  # the weights without their moments
    return {
        "format": ckpt.manifest.format,
        **{name: [step(m, 2), step(m, 3)] for name, m in (("plain", module), ("resumed", resumed), ("rolled", rolled))},
        "fresh": [step(fresh, 2), step(fresh, 3)],
    }


def test_full_weights_checkpoint_resumes_weights_and_optimizer(tmp_path):
    res = run_distributed(_full_weights_resume, 1, str(tmp_path), timeout=600, fresh=False)[0]
    assert res["format"] == FORMAT_FULL
    assert res["resumed"] == res["plain"] and res["rolled"] == res["plain"], res
    assert res["fresh"][0] == res["plain"][0] and res["fresh"][1] != res["plain"][1], "the moments shape step 3"
