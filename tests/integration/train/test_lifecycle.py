"""The training lifecycle on real gloo ranks: the TrainModule (full state dict, rebuild mid-run, given weights, the
optimizer moments round trip) in one pair of processes, and the default demo on 1 worker in the command's process
and on 3 and 4 through Ray."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.harness import cli, learnable_batches, run_distributed, tiny_config, train_steps
from tests.unit.train.test_worker import DEMO

# -- the TrainModule on 2 workers: rebuild mid-run, given weights, optimizer moments ------------------------

STEPS, REBUILD_AT = 6, 3


def _small(*extra: str):
    return tiny_config(
        "model.dropout=0.1",
        "zero.stage=3",
        "cluster.num_workers=2",
        "train.global_batch_size=8",
        "train.micro_batch_size=2",
        "data.num_streams=2",
        "train.lr=1e-2",
        "train.warmup_steps=1",
        f"train.max_steps={STEPS}",
        "train.precision=fp32",
        *extra,
    )


def _rebuild_mid_run(rank: int, world: int) -> dict:
    """ZeRO-3 with dropout: the same 6 steps without and with a rebuild (new engine) at step 3 on the gathered
    weights and the optimizer state."""
    from pretrain.train.module import build_module

    cfg = _small()
    data = learnable_batches(STEPS, 8)

    def run(rebuild: bool) -> tuple[list[float], list[float], dict]:
        module = build_module(cfg)

        def before(step: int) -> None:
            if rebuild and step == REBUILD_AT:
                full = module.full_state_dict()
                module.rebuild(cfg, weights=full, optimizer_state=module.optimizer_state())

        results = train_steps(module, data, rank, world, seeds=True, before=before)
        return [r.loss for r in results], [r.grad_norm for r in results], module.full_state_dict()

    plain_losses, plain_norms, plain_final = run(False)
    losses, norms, final = run(True)
    return {
        "plain": plain_losses,
        "rebuilt": losses,
        "plain_norms": plain_norms,
        "norms": norms,
        "same_weights": all(torch.equal(plain_final[k], final[k]) for k in plain_final),
        "keys": sorted(final),
        "shapes": {k: tuple(v.shape) for k, v in final.items()},
    }


def _rebuild_without_optimizer_state(rank: int, world: int) -> tuple[float, float, dict]:
    """Rebuild on the same weights with a fresh optimizer: the function is unchanged (same eval loss)."""
    from pretrain.train.module import build_module
    from pretrain.train.step import StepInput, evaluate, run_step

    cfg = _small("model.dropout=0.0", "zero.stage=2")
    module = build_module(cfg)
    ids = (torch.arange(8).view(8, 1) + torch.arange(16)) % 101
    shard = {"input_ids": ids[rank * 4 : (rank + 1) * 4], "labels": ids[rank * 4 : (rank + 1) * 4]}
    run_step(module, StepInput(1, shard, 1e-2))
    before = evaluate(module, [shard])["val/loss"]
    module.rebuild(weights=module.full_state_dict())
    after = evaluate(module, [shard])["val/loss"]
    # bf16: DeepSpeed casts the module before copying the fp32 masters; given weights keep every bit in them.
    g = torch.Generator().manual_seed(0)  # the same on every rank
    given = {k: v + 1e-4 * torch.randn(v.shape, generator=g) for k, v in module.full_state_dict().items()}
    given["lm_head.weight"] = given["embed_tokens.weight"]  # tied
    masters = {}
    for stage in (0, 1, 2, 3):
        bf16 = build_module(_small("model.dropout=0.0", f"zero.stage={stage}", "train.precision=bf16"), weights=given)
        got = bf16.full_state_dict()
        masters[stage] = max((got[k] - given[k]).abs().max().item() for k in given)
        bf16.engine.destroy()
    return before, after, masters


def _optimizer_roundtrip(rank: int, world: int, stages: list[int]) -> dict:
    """Rebuild on the gathered weights with a fresh optimizer, then put back the gathered full AdamW moments."""
    from pretrain.train.module import build_module
    from pretrain.train.optimizer_state import gather_moments, load_moments

    data = learnable_batches(STEPS, 8)
    out = {}
    for stage in stages:
        cfg = _small("model.dropout=0.0", f"zero.stage={stage}")

        def run(mode: str, cfg=cfg) -> list[float]:
            module = build_module(cfg)

            def before(step: int) -> None:
                if mode != "plain" and step == REBUILD_AT:
                    moments = gather_moments(module)
                    assert moments["step"] == REBUILD_AT and moments["exp_avg"]
                    module.rebuild(cfg, weights=module.full_state_dict())
                    if mode == "moments":
                        load_moments(module, moments)

            return [r.loss for r in train_steps(module, data, rank, world, before=before)]

        out[stage] = (run("plain"), run("moments"), run("fresh"))
    return out


def _module_runs(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    return {
        "rebuild": _rebuild_mid_run(rank, world),
        "given": _rebuild_without_optimizer_state(rank, world),
        "moments": _optimizer_roundtrip(rank, world, [0, 1, 2, 3]),
    }


@pytest.fixture(scope="module")
def module_runs():
    """The three TrainModule runs below, in one call to the session's pair of real gloo processes."""
    return run_distributed(_module_runs, 2, timeout=900, fresh=False)


def test_rebuild_mid_run_under_zero3_is_bitwise(module_runs):
    """2 workers, ZeRO-3, dropout on: rebuilding the module (new DeepSpeed engine) at step 3 on the gathered
    weights and the optimizer state leaves every later loss, gradient norm and the final weights bitwise equal."""
    ranks = [r["rebuild"] for r in module_runs]
    r0 = ranks[0]
    assert r0["rebuilt"] == r0["plain"] and r0["norms"] == r0["plain_norms"], (r0["plain"], r0["rebuilt"])
    assert r0["same_weights"] and ranks[1]["same_weights"]
    assert r0["rebuilt"][-1] < r0["rebuilt"][0], "it trains"
    # The full state dict is gathered from the ZeRO-3 partitions: full shapes, identical on both ranks.
    assert r0["shapes"]["blocks.0.attn.q_proj.weight"] == (32, 32) and r0["shapes"] == ranks[1]["shapes"]


def test_rebuild_with_given_weights_zero2_and_bf16_masters_keep_them_exactly(module_runs):
    before, after, masters = module_runs[0]["given"]
    assert before == after
    assert masters == {0: 0.0, 1: 0.0, 2: 0.0, 3: 0.0}, masters


def test_full_optimizer_moments_roundtrip_zero_0_to_3(module_runs):
    """The gathered AdamW moments (what growth.optimizer grow transforms) restore into a fresh engine on every ZeRO
    stage: the following losses equal the uninterrupted run's (and differ with a fresh optimizer)."""
    res = module_runs[0]["moments"]
    for stage, (plain, restored, fresh) in res.items():
        diff = max(abs(a - b) for a, b in zip(plain, restored))
        print(
            f"ZeRO-{stage}: restored moments max |diff| {diff:.2e}; fresh optimizer "
            f"{max(abs(a - b) for a, b in zip(plain, fresh)):.2e}"
        )
        assert diff < 1e-6, (stage, plain, restored)
        assert max(abs(a - b) for a, b in zip(plain, fresh)) > 1e-4


# -- the default demo on 1, 3 and 4 workers ----------------------------------------------------------------


def test_default_demo_runs_on_1_3_and_4_workers(tmp_path):
    """``./launch.sh train cluster.num_workers=W`` as users run it (the CLI), with the demo's global batch 16 and
    micro-batch cap 16: one worker trains in the command's process (the default, and the README's main job), 3 and
    4 workers through Ray Train on an embedded local Ray (3: uneven 6/6/4 shares padded to equal passes; 4: more
    workers than CPUs, each taking a fractional ``cluster.cpus_per_worker``, as the refusal of a whole CPU each
    says). Every rank of those runs as a Ray Train worker, none waits for placement, and the same global batches
    give the same losses up to float rounding. Two workers through Ray on this preset: ``test_golden.py``'s
    ``decoder-2w-zero2-dropout``; one through Ray (``cluster.ray_for_one_worker=true``): ``test_console.py``."""
    import json
    import math
    import os

    steps = [
        "train.max_steps=3",
        "train.log_every=1",
        "train.val_every=0",
        "train.val_sequences=12",
        "checkpoint.every_steps=0",
        "data.tokenizer_train_docs=3000",
        "stability.plot_at_end=false",
        "tracking.enabled=false",
    ]
    cpus = os.cpu_count() or 1
    finals, tok = {}, []
    for workers in (1, 3, 4):
        share = min(1.0, math.floor(cpus / workers * 100) / 100)
        proc = cli(
            tmp_path,
            "train",
            str(DEMO),
            *steps,
            *tok,
            f"cluster.num_workers={workers}",
            f"cluster.cpus_per_worker={share:g}",
            expect=0,
            timeout=900,
        )
        run_dir = Path(proc.stdout.split("checkpoints in ", 1)[1].split()[0])
        ranks = {int(r) for r in re.findall(rf"^\[train\] rank (\d)/{workers} on Ray node", proc.stdout, re.M)}
        assert ranks == (set(range(workers)) if workers > 1 else set()), (workers, proc.stdout[-3000:])
        assert f"plan: {workers} worker(s), global batch 16" in proc.stdout
        assert "waiting for the cluster" not in proc.stdout
        tok = tok or [f"data.tokenizer={run_dir / 'tokenizer'}"]
        finals[workers] = json.loads((run_dir / "summary.json").read_text())
    ref = finals[1]
    assert ref["step"] == 3 and ref["checkpoint"]
    for workers, final in finals.items():
        assert final["step"] == 3 and final["tokens_seen"] == 3 * 16 * 128, workers
        assert abs(final["final_train_loss"] - ref["final_train_loss"]) < 1e-4, (workers, final, ref)
        assert abs(final["val_loss"] - ref["val_loss"]) < 1e-4, (workers, final["val_loss"], ref["val_loss"])
