"""Stability control on real gloo ranks: the skip as an exact no-op for every ZeRO stage (a table of layouts run
once), and halt with a report through the CLI, then the plot; and a deep post-LN model (48 blocks, 100 steps in one
process) that stalls without a stabilizer and trains with DeepNorm. Fault injection in real 2-worker training
(NaN skipped, spike rolled back, resume through a rollback): ``test_stability_faults.py``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from pretrain.config import ModelConfig
from tests.harness import Case, case_ids, cli, run_cases, shard, tiny_config
from tests.integration.train.test_stability_faults import TINY

# ----------------------------------------------------------------------------------------------
# The skip is an exact no-op, for every ZeRO stage (2 real gloo ranks)
# ----------------------------------------------------------------------------------------------

LAYOUTS = [
    Case(f"z{stage}-{precision}", (f"zero.stage={stage}", f"train.precision={precision}"), 2)
    for stage, precision in [(0, "fp32"), (1, "fp32"), (2, "fp32"), (3, "fp32"), (0, "bf16"), (1, "bf16")]
]


def _engine_cfg(world: int, overrides: list[str]):
    return tiny_config(
        f"cluster.num_workers={world}",
        "train.global_batch_size=8",
        "train.micro_batch_size=2",
        "data.num_streams=2",
        "train.seed=3",
        *overrides,
    )


def _snapshot(engine) -> list[torch.Tensor]:
    """This rank's parameters, master weights and optimizer state."""
    from pretrain.ds_adapter import base_optimizer
    from pretrain.train.health import param_views

    out = [t.detach().clone() for _, t in param_views(engine)[0]]
    for state in base_optimizer(engine.optimizer).state.values():
        out += [v.detach().clone() if torch.is_tensor(v) else torch.tensor(float(v)) for _, v in sorted(state.items())]
    for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat_partition"):
        out += [t.detach().clone() for t in getattr(engine.optimizer, name, None) or []]
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


class _Verdict:
    def __init__(self, apply: bool):
        self.apply = apply


class _Verdict:
    def __init__(self, apply: bool):
        self.apply = apply


def _skip_worker(rank: int, world: int, overrides: list[str], ckpt_dir: str) -> dict:
    """One layout, two trajectories of the same data: with skipped updates (a skipped first step, a skip with finite
    gradients, one with a NaN gradient on the last rank only) and without them."""
    from pretrain.train.callbacks.fault_injection import _NaNGrad
    from pretrain.train.callbacks.health import HealthCallback
    from pretrain.train.health import HealthProbe
    from pretrain.train.module import build_module
    from pretrain.train.step import StepHooks, StepInput, run_step

    class Guard(StepHooks):
        """The verdict of every update, and NaN gradients on this rank when ``corrupt``."""

        def __init__(self, apply: bool, corrupt: bool):
            self.apply, self.corrupt = apply, corrupt

        def decide(self, signals):
            return _Verdict(self.apply)

        def objective(self, objective, index, count):
            return _NaNGrad.apply(objective) if self.corrupt and index == count - 1 else objective

    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 101, (8, 16), generator=g) for _ in range(4)]
    per = 8 // world
    out: dict = {}
    finals = []
    for trajectory in ("with_skips", "without"):
        cfg = _engine_cfg(world, overrides)
        stage, precision = cfg.zero.stage, cfg.train.precision
        module = build_module(cfg)
        assert module.plan.micro_batch == 2 and module.plan.shares == (per,) * world
        assert module.precision == precision and module.cfg.train.weight_decay == 0.1
        engine = module.engine
        health = HealthCallback(every=1)

        def step(ids, apply=True, probe=False, corrupt=False, module=module, health=health):
            part = shard(ids, rank, world)
            health.probe = HealthProbe(module.engine, module.plan.dims) if probe else None
            health.health = {}
            r = run_step(
                module,
                StepInput(1, {"input_ids": part, "labels": part}, 1e-2),
                [Guard(apply, corrupt and rank == world - 1), health],
            )
            return r, health.health

        if trajectory == "with_skips":
            before = _snapshot(engine)
            step(data[3], apply=False)  # a skipped *first* step (nothing initialized yet)
            out["first_skip_unchanged"] = _same(before, _snapshot(engine))
        r, health_metrics = step(data[0], probe=True)
        out["health"] = {k: v for k, v in health_metrics.items() if "/" not in k[7:] or "block01" in k}
        out["grad_norm"] = r.grad_norm
        step(data[1])
        if trajectory == "with_skips":
            before = _snapshot(engine)
            r, _ = step(data[3], apply=False)  # finite gradients: DeepSpeed alone would update
            out["skip_unchanged"] = _same(before, _snapshot(engine)) and math.isfinite(r.grad_norm)
            r, _ = step(data[2], apply=False, corrupt=True)  # NaN on one rank only
            out["nan_seen"] = not math.isfinite(r.grad_norm)
            out["nan_unchanged"] = _same(before, _snapshot(engine))
            if stage == 1 and precision == "fp32":  # a rollback's restore, mid-training, is exact
                engine.save_checkpoint(ckpt_dir, tag="t")
                saved = _snapshot(engine)
                step(data[2])
                engine.load_checkpoint(ckpt_dir, tag="t")
                out["restore_exact"] = _same(saved, _snapshot(engine))
        r, _ = step(data[2])
        finals.append((r.loss, _snapshot(engine)))
        if stage == 1 and precision == "fp32" and trajectory == "with_skips":
            out["nan_checkpoint_refused"] = _refuses_nan_checkpoint(module, cfg, rank, Path(ckpt_dir) / "run")
    out["same_as_never_seen"] = finals[0][0] == finals[1][0] and _same(finals[0][1], finals[1][1])
    return out


def _refuses_nan_checkpoint(module, cfg, rank: int, run_dir: Path) -> bool:
    """One NaN in rank 1's replica only: every rank refuses the checkpoint, nothing is staged or counted."""
    from pretrain.train import dist
    from pretrain.train.checkpointer import Checkpointer, NonFiniteWeightsError
    from pretrain.train.tracking import Tracker
    from pretrain.train.trainer import TrainerState

    if rank == 1:
        next(module.engine.module.parameters()).data.view(-1)[0] = float("nan")
    checkpointer = Checkpointer(cfg, run_dir, dist.setup("no"), Tracker("", "x"))
    try:
        checkpointer.save(module, None, TrainerState(step=9))
    except NonFiniteWeightsError:
        return not run_dir.exists() and checkpointer.count == 0 and not checkpointer.records
    return False


@pytest.fixture(scope="module")
def skip_runs(tmp_path_factory):
    return run_cases(_skip_worker, LAYOUTS, str(tmp_path_factory.mktemp("skip") / "ds"), timeout=600)


@pytest.mark.parametrize("case", LAYOUTS, ids=case_ids(LAYOUTS))
def test_skip_leaves_weights_and_optimizer_bitwise_unchanged_all_stages(skip_runs, case):
    """A skipped update (the first step, finite gradients, a NaN gradient on one rank) leaves the parameters, master
    weights and optimizer state bitwise unchanged, and the run ends where one that never saw the skipped batches
    ends; the health metrics are the same whatever the ZeRO stage holds where. Under ZeRO-1 (fp32) a rollback's
    restore is exact and a checkpoint with a NaN in one rank's replica is refused on every rank."""
    ranks = skip_runs[case.id]
    r0, r1 = ranks
    assert r0 == r1 or all(r0[k] == r1[k] for k in r0 if k != "health")
    print(f"\n{case.id}: " + ", ".join(f"{k}={v}" for k, v in r0.items() if k != "health"))
    for check in ("first_skip_unchanged", "skip_unchanged", "nan_seen", "nan_unchanged", "same_as_never_seen"):
        assert r0[check] is True, (case.id, check)
    health = r0["health"]
    assert health["health/grad_norm"] == pytest.approx(r0["grad_norm"], rel=1e-4)
    assert health["health/nonfinite_grads"] == 0 and 0 < health["health/update_ratio"] < 1
    assert {
        "health/act_rms/block01",
        "health/act_max/block01",
        "health/attn_logit_max",
        "health/logit_ms",
        "health/param_norm/block01",
    } <= set(health)
    if case.id == "z1-fp32":
        assert r0["restore_exact"] is True and r0["nan_checkpoint_refused"] is True
        print("health metrics (ZeRO-1):", {k: round(v, 5) for k, v in health.items()})
    if case.id in ("z0-fp32", "z2-fp32", "z3-fp32"):  # the same numbers whatever the stage holds where
        ref = skip_runs["z1-fp32"][0]["health"]
        for k in (
            "health/grad_norm",
            "health/param_norm",
            "health/update_ratio",
            "health/grad_norm/block01",
            "health/act_rms/block01",
            "health/attn_logit_max",
        ):
            assert health[k] == pytest.approx(ref[k], rel=1e-4), (case.id, k)


# ----------------------------------------------------------------------------------------------
# Halt, through the CLI (one in-process worker), and the plot command
# ----------------------------------------------------------------------------------------------


def test_halt_policy_stops_with_one_line_and_a_report_then_plot(tmp_path):
    """Through Ray, 2 workers, restarts allowed (``cluster.max_failures=1``): a halt ends the run once, as a
    result, not a failure that Ray Train retries from the last checkpoint."""
    args = [a.replace("cluster.use_ray=false", "cluster.use_ray=true") for a in TINY]
    # a save at step 2 (asynchronous: still in flight when step 3 halts) is committed before the run ends
    halt = ["stability.policy=halt", "faults.nan_grad_at_step=3", "cluster.max_failures=1", "checkpoint.every_steps=2"]
    proc = cli(tmp_path, "train", *args, *halt, expect=1)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "stability halt at step 3: nonfinite" in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "[train] HALT:" in proc.stdout
    assert proc.stdout.count("stability event #1 at step 3: nonfinite -> halt") == 1, "not retried"
    run_id = next(
        line.split()[2].rstrip(":") for line in proc.stdout.splitlines() if line.startswith("[pretrain] run ")
    )
    report = json.loads((tmp_path / "checkpoints" / run_id / "stability_report.json").read_text())
    assert report["halted"]["step"] == 3 and report["policy"] == "halt"
    assert [p.name for p in (tmp_path / "checkpoints" / run_id).glob("step_*")] == ["step_00000002"]

    plot = cli(tmp_path, "runs", run_id, "--plot", expect=0, timeout=120)
    path = Path(plot.stdout.strip().splitlines()[-1].split("plot: ", 1)[1])
    assert path.is_file() and path.stat().st_size > 10_000
    print("\n" + errors[0] + "\nplot:", path)


# -- a deep post-LN model: stalls without a stabilizer, trains with DeepNorm (100 steps of 48 blocks) -------------


def _train_synthetic(cfg: ModelConfig, lr: float, steps: int, seed: int = 1) -> list[float]:
    """Plain AdamW on learnable sequences (start + stride * t mod V), no LR warm-up: loss per step."""
    from pretrain.model import build_model

    torch.manual_seed(seed)
    model = build_model(cfg, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        ids = (
            torch.randint(0, 101, (8, 1), generator=g) + torch.randint(1, 4, (8, 1), generator=g) * torch.arange(16)
        ) % 101
        out = model(ids, labels=ids)
        (out.loss + (out.z_loss if out.z_loss is not None else 0.0)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(out.loss.item())
    return losses


def test_deep_post_ln_stalls_without_a_stabilizer_and_trains_with_deepnorm():
    """48 layers of width 32, post-LN, LR 1.2e-2 without warm-up: plain post-LN is stuck at the uniform
    loss ln(101) = 4.62; DeepNorm residual scaling (+ its init and an embedding norm) trains."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small matmuls: threads only contend
    try:
        _deep_post_ln()
    finally:
        torch.set_num_threads(threads)


def _deep_post_ln() -> None:
    base = dict(
        vocab_size=101, max_seq_len=16, num_layers=48, hidden_size=32, num_heads=4, norm="layernorm", position="learned"
    )
    runs = {
        "post-LN": ModelConfig(**base, norm_placement="post"),
        "post-LN + DeepNorm": ModelConfig(**base, norm_placement="deepnorm", embedding_norm=True),
    }
    means = {}
    for name, cfg in runs.items():
        losses = _train_synthetic(cfg, lr=1.2e-2, steps=100)
        means[name] = [sum(losses[i : i + 10]) / 10 for i in range(0, 100, 10)]
        print(f"\n{name:>20}: loss per 10 steps " + " ".join(f"{x:.3f}" for x in means[name]))
    assert means["post-LN"][-1] > 4.3, "plain deep post-LN should stall near ln(V) here"
    assert means["post-LN + DeepNorm"][-1] < 3.0, "DeepNorm should train"
