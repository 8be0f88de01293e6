"""Stability monitoring and control: detectors and policies (pure), model stabilizers, the skip as an
exact no-op for every ZeRO stage (real gloo), fault injection in real 2-worker training (NaN skipped,
spike rolled back), bitwise resume through a rollback, halt with a report, and the PNG."""

from __future__ import annotations

import json
import math
import subprocess
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from pretrain.config import ConfigError, ModelConfig, StabilityConfig, load_config
from pretrain.train.stability import StabilityMonitor, StepSignals, robust_z, trend_rise
from tests.conftest import PYTHON, ROOT, cli_env, in_workdir
from tests.distributed import run_distributed, train_jobs

# ----------------------------------------------------------------------------------------------
# The functional core
# ----------------------------------------------------------------------------------------------


def _noisy(step: int, base: float = 3.0) -> float:
    """A deterministic, gently noisy, slowly falling series."""
    return base - 0.001 * step + 0.02 * math.sin(step * 1.7)


def _monitor(**kw) -> StabilityMonitor:
    defaults = dict(window=32, warmup_steps=10, good_after_steps=3, divergence_window=0)
    return StabilityMonitor(StabilityConfig(**{**defaults, **kw}))


def _feed(m: StabilityMonitor, steps: range, loss=_noisy, grad=lambda s: 1.0 + 0.05 * math.cos(s)):
    return [m.decide(StepSignals(s, loss(s), grad(s))) for s in steps]


def test_robust_statistics_and_trend():
    hist = [1.0, 1.1, 0.9, 1.0, 1.05, 0.95, 1.0, 1.02]
    assert robust_z(5.0, hist[:5]) is None  # too little history
    assert robust_z(1.0, hist) == pytest.approx(0.0, abs=1e-9)
    assert robust_z(5.0, hist) > 20 and robust_z(0.5, hist) < 0  # one-sided use: only rises are spikes
    assert robust_z(1.01, [1.0] * 10) == pytest.approx(1.0)  # sigma floor: 1% of the median
    assert trend_rise([1.0 + 0.01 * i for i in range(50)]) == pytest.approx(0.49 / 1.245, rel=1e-6)
    assert trend_rise([3.0 - 0.01 * i for i in range(50)]) < 0


@pytest.mark.parametrize("policy, action", [("log", "log"), ("skip", "skip"), ("rollback", "rollback"),
                                            ("halt", "halt")])
def test_loss_spike_action_per_policy(policy, action):
    m = _monitor(policy=policy)
    assert all(d.action == "ok" for d in _feed(m, range(1, 30)))
    m.note_checkpoint(29, "/ckpt/29", 29 * 8)
    _feed(m, range(30, 33))  # 3 healthy steps: checkpoint 29 becomes good
    d = m.decide(StepSignals(33, 9.0, 1.0))
    assert d.action == action and d.event["kind"] == "loss_spike"
    assert d.apply == (action == "log")
    assert m.decide(StepSignals(34, float("nan"), float("nan"))).action == {"log": "log", "skip": "skip",
                                                                            "rollback": "skip", "halt": "halt"}[policy]


def test_warmup_and_grad_spike_and_nonfinite():
    m = _monitor(policy="skip")
    assert m.decide(StepSignals(3, 50.0, 1.0)).action == "ok"  # warm-up: no spike detection...
    assert m.decide(StepSignals(4, 3.0, float("inf"))).action == "skip"  # ... but non-finite always
    _feed(m, range(5, 30))
    d = m.decide(StepSignals(30, _noisy(30), 40.0))
    assert (d.action, d.event["kind"]) == ("skip", "grad_spike")
    quiet = _monitor(policy="skip", detect_grad_spikes=False)
    _feed(quiet, range(1, 30))
    assert quiet.decide(StepSignals(30, _noisy(30), 40.0)).action == "ok"


def test_consecutive_skips_escalate_and_rollbacks_are_limited():
    m = _monitor(policy="skip", max_consecutive_skips=3)
    _feed(m, range(1, 20))
    nan = StepSignals(20, float("nan"), float("nan"))
    assert [m.decide(nan).action for _ in range(3)] == ["skip", "skip", "halt"]

    m = _monitor(policy="rollback", max_consecutive_skips=2, max_rollbacks=1)
    _feed(m, range(1, 20))
    assert m.decide(nan).action == "skip"
    assert m.decide(nan).action == "halt"  # escalation to rollback, but no good checkpoint exists
    m = _monitor(policy="rollback", max_rollbacks=1)
    _feed(m, range(1, 20))
    m.note_checkpoint(19, "/c/19", 152)
    _feed(m, range(20, 25))
    assert m.decide(StepSignals(25, 9.0, 1.0)).action == "rollback"
    ev = m.rolled_back(25, m.rollback_target(), 152, 200, [])
    assert ev["data_window"] == [152, 200] and m.s.skipped_windows == [[152, 200]]
    assert m.lr_factor(20) == 0.5 and m.lr_factor(19 + 50) == 0.5 and m.lr_factor(19 + 51) == 1.0
    _feed(m, range(20, 30))
    assert m.decide(StepSignals(30, 9.0, 1.0)).action == "halt"  # the second rollback is over the limit


def test_checkpoint_goodness_taint_and_target():
    m = _monitor(policy="rollback", good_after_steps=3)
    _feed(m, range(1, 20))
    m.note_checkpoint(19, "/c/19", 1)
    _feed(m, range(20, 23))
    m.note_checkpoint(22, "/c/22", 2)
    _feed(m, range(23, 25))  # 22 has seen 2 healthy steps: pending
    assert m.rollback_target()["step"] == 19
    assert m.decide(StepSignals(25, 9.0, 1.0)).action == "rollback"
    _feed(m, range(26, 30))  # a spike tainted 22: never a target, however many healthy steps follow
    assert m.rollback_target()["step"] == 19 and [c["step"] for c in m.s.checkpoints] == [19]
    assert m.protected_paths() == {"/c/19"}


def test_nonfinite_weights_roll_back_or_halt():
    m = _monitor(policy="rollback")
    _feed(m, range(1, 20))
    assert m.nonfinite_weights(19).action == "halt"  # no good checkpoint yet
    m.note_checkpoint(19, "/c/19", 1)
    _feed(m, range(20, 24))
    assert m.nonfinite_weights(24).action == "rollback"
    assert _monitor(policy="skip").nonfinite_weights(5).action == "halt"


def test_divergence_is_detected_once_per_window():
    m = _monitor(policy="rollback", divergence_window=40, divergence_threshold=0.05)
    m.note_checkpoint(1, "/c/1", 0)
    rising = [m.decide(StepSignals(s, 2.0 + 0.004 * s + 0.01 * math.sin(s), 1.0)) for s in range(1, 120)]
    kinds = [(d.event["step"], d.action) for d in rising if d.event]
    print("\ndivergence events:", kinds)
    assert kinds and kinds[0][1] == "rollback" and all(k == "rollback" for _, k in kinds)
    assert all(b - a >= 40 for (a, _), (b, _) in zip(kinds, kinds[1:]))
    flat = _monitor(divergence_window=40)
    assert not any(d.event for d in _feed(flat, range(1, 200)))


def test_state_round_trip_gives_identical_decisions():
    sig = [StepSignals(s, 9.0 if s in (40, 41) else _noisy(s), float("nan") if s == 50 else 1.0) for s in range(1, 80)]
    a = _monitor(policy="skip")
    first = [a.decide(x) for x in sig[:30]]
    b = _monitor(policy="skip")
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))  # as in trainer_state.json
    rest_a, rest_b = [a.decide(x) for x in sig[30:]], [b.decide(x) for x in sig[30:]]
    assert [d.action for d in rest_a] == [d.action for d in rest_b]
    assert a.state_dict() == b.state_dict()
    assert [e["step"] for e in a.s.timeline] == [40, 41, 50] and all(d.action == "ok" for d in first)


def test_stability_config_validation():
    cfg = load_config(ROOT / "configs" / "demo-decoder.yaml")
    assert cfg.stability.policy == "skip" and cfg.stability.health_every > 0
    for override, message in [("stability.policy=undo", "stability.policy: expected one of log, skip"),
                              ("stability.window=4", "stability.window: must be >= 8"),
                              ("stability.spike_threshold=0", "stability.spike_threshold: must be > 0"),
                              ("stability.lr_cooldown_factor=2", "stability.lr_cooldown_factor"),
                              ("model.z_loss=-1", "model.z_loss: must be >= 0"),
                              ("faults.nan_grad_at_step=x", "faults.nan_grad_at_step: expected int")]:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
            load_config(None, [override])


# ----------------------------------------------------------------------------------------------
# Model stabilizers
# ----------------------------------------------------------------------------------------------


def _tiny(**kw) -> ModelConfig:
    return ModelConfig(vocab_size=101, max_seq_len=16, num_layers=2, hidden_size=32, num_heads=4, **kw)


def test_stabilizers_are_off_by_default_and_do_what_they_say():
    from pretrain.model import build_model

    ids = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(0))
    plain = build_model(_tiny(), 0)
    assert not any("q_norm" in k for k in plain.state_dict()) and plain.embedding_scale == 1.0
    out = plain(ids, labels=ids)
    assert out.z_loss is None

    z = build_model(_tiny(z_loss=1e-3), 0)  # same weights: the z-loss adds no parameters
    zout = z(ids, labels=ids)
    assert torch.equal(zout.loss, out.loss)
    lse = torch.logsumexp(out.logits[:, :-1].float(), -1)
    torch.testing.assert_close(zout.z_loss, 1e-3 * lse.pow(2).mean())

    qk = build_model(_tiny(qk_norm=True), 0)
    assert {"blocks.0.attn.q_norm.weight", "blocks.0.attn.k_norm.weight"} <= set(qk.state_dict())
    assert qk.blocks[0].attn.q_norm.weight.shape == (8,)
    scaled = build_model(_tiny(embedding_scale=0.0), 0)
    assert scaled.embedding_scale == pytest.approx(math.sqrt(32))

    # The attention-logit probe is a side computation: outputs are bitwise unchanged.
    attn = plain.blocks[0].attn
    attn.probe_logits = True
    probed = plain(ids).logits
    assert torch.equal(probed, out.logits) and attn.last_logit_max is not None
    x = plain.blocks[0].norm1(plain.embed_tokens(ids))
    from pretrain.model.layers import apply_rotary

    q = attn.q_proj(x).view(2, 16, 4, 8).transpose(1, 2)
    k = attn.k_proj(x).view(2, 16, 4, 8).transpose(1, 2)
    cos, sin = plain.rope_cos[:16], plain.rope_sin[:16]
    s = apply_rotary(q, cos, sin) @ apply_rotary(k, cos, sin).transpose(-1, -2) / math.sqrt(8)
    s = s.masked_fill(torch.ones(16, 16, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(attn.last_logit_max, s.amax())


def _train_synthetic(cfg: ModelConfig, lr: float, steps: int, seed: int = 1) -> list[float]:
    """Plain AdamW on learnable sequences (start + stride * t mod V), no LR warm-up: loss per step."""
    from pretrain.model import build_model

    torch.manual_seed(seed)
    model = build_model(cfg, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        ids = (torch.randint(0, 101, (8, 1), generator=g) + torch.randint(1, 4, (8, 1), generator=g)
               * torch.arange(16)) % 101
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
    base = dict(vocab_size=101, max_seq_len=16, num_layers=48, hidden_size=32, num_heads=4, norm="layernorm",
                position="learned")
    runs = {"post-LN": ModelConfig(**base, norm_placement="post"),
            "post-LN + DeepNorm": ModelConfig(**base, norm_placement="deepnorm", embedding_norm=True)}
    means = {}
    for name, cfg in runs.items():
        losses = _train_synthetic(cfg, lr=1.2e-2, steps=100)
        means[name] = [sum(losses[i:i + 10]) / 10 for i in range(0, 100, 10)]
        print(f"\n{name:>20}: loss per 10 steps " + " ".join(f"{x:.3f}" for x in means[name]))
    assert means["post-LN"][-1] > 4.3, "plain deep post-LN should stall near ln(V) here"
    assert means["post-LN + DeepNorm"][-1] < 3.0, "DeepNorm should train"


# ----------------------------------------------------------------------------------------------
# The picture
# ----------------------------------------------------------------------------------------------


def test_plot_training_png(tmp_path):
    from pretrain.train.plot import plot_training, split_replayed

    final, gone = split_replayed([(5, 1.0), (10, 0.9), (14, 143.0), (10, 0.95), (15, 0.8)])
    assert final == [(5, 1.0), (10, 0.95), (15, 0.8)] and gone == [[(10, 0.9), (14, 143.0)]]
    series = {"train/loss": [(s, 3 - 0.01 * s) for s in range(1, 15)] + [(15, 40.0)] +
              [(s, 3 - 0.011 * s) for s in range(9, 40)],
              "train/grad_norm": [(s, 1.0) for s in range(1, 40)], "val/loss": [(20, 2.8), (39, 2.6)]}
    events = [{"step": 5, "kind": "nonfinite", "action": "skip"},
              {"step": 15, "kind": "loss_spike", "action": "rollback"},
              {"step": 15, "kind": "rollback", "action": "restored", "to_step": 8}]
    out = plot_training(series, events, tmp_path / "p.png", title="test")
    assert out.stat().st_size > 10_000 and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------------------------------
# The skip is an exact no-op, for every ZeRO stage (2 real gloo ranks)
# ----------------------------------------------------------------------------------------------


def _engine_cfg(stage: int, world: int, precision: str):
    return load_config(None, [
        "model.vocab_size=101", "model.num_layers=2", "model.hidden_size=32", "model.num_heads=4",
        "model.max_seq_len=16", f"zero.stage={stage}", f"cluster.num_workers={world}", "train.global_batch_size=8",
        "train.micro_batch_size=2", "data.num_streams=2", f"train.precision={precision}", "train.seed=3"])


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


def _skip_worker(rank: int, world: int, layouts: list[tuple[int, str]], ckpt_dir: str) -> dict:
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

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 101, (8, 16), generator=g) for _ in range(4)]
    per = 8 // world
    out: dict = {}
    for stage, precision in layouts:
        key = f"z{stage}-{precision}"
        finals = []
        for trajectory in ("with_skips", "without"):
            cfg = _engine_cfg(stage, world, precision)
            module = build_module(cfg)
            assert module.plan.micro_batch == 2 and module.plan.shares == (per,) * world
            assert module.precision == precision and module.cfg.train.weight_decay == 0.1
            engine = module.engine
            health = HealthCallback(every=1)

            def step(ids, apply=True, probe=False, corrupt=False, module=module, health=health):
                shard = ids[rank * per:(rank + 1) * per]
                health.probe = HealthProbe(module.engine) if probe else None
                health.health = {}
                r = run_step(module, StepInput(1, {"input_ids": shard, "labels": shard}, 1e-2),
                             [Guard(apply, corrupt and rank == world - 1), health])
                return r, health.health

            if trajectory == "with_skips":
                before = _snapshot(engine)
                step(data[3], apply=False)  # a skipped *first* step (nothing initialized yet)
                out[f"{key}/first_skip_unchanged"] = _same(before, _snapshot(engine))
            r, health_metrics = step(data[0], probe=True)
            out[f"{key}/health"] = {k: v for k, v in health_metrics.items() if "/" not in k[7:] or "block01" in k}
            out[f"{key}/grad_norm"] = r.grad_norm
            step(data[1])
            if trajectory == "with_skips":
                before = _snapshot(engine)
                r, _ = step(data[3], apply=False)  # finite gradients: DeepSpeed alone would update
                out[f"{key}/skip_unchanged"] = _same(before, _snapshot(engine)) and math.isfinite(r.grad_norm)
                r, _ = step(data[2], apply=False, corrupt=True)  # NaN on one rank only
                out[f"{key}/nan_seen"] = not math.isfinite(r.grad_norm)
                out[f"{key}/nan_unchanged"] = _same(before, _snapshot(engine))
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
        out[f"{key}/same_as_never_seen"] = finals[0][0] == finals[1][0] and _same(finals[0][1], finals[1][1])
    return out


def _refuses_nan_checkpoint(module, cfg, rank: int, run_dir: Path) -> bool:
    """One NaN in rank 1's replica only: every rank refuses the checkpoint, nothing is staged."""
    from pretrain.train import dist
    from pretrain.train.checkpointer import Checkpointer, NonFiniteWeightsError
    from pretrain.train.tracking import Tracker
    from pretrain.train.trainer import TrainerState

    if rank == 1:
        next(module.engine.module.parameters()).data.view(-1)[0] = float("nan")
    try:
        Checkpointer(cfg, run_dir, dist.setup("no"), Tracker("", "x")).save(module, None, TrainerState(step=9))
    except NonFiniteWeightsError:
        return not run_dir.exists()
    return False


@pytest.mark.slow
def test_skip_leaves_weights_and_optimizer_bitwise_unchanged_all_stages(tmp_path):
    layouts = [(0, "fp32"), (1, "fp32"), (2, "fp32"), (3, "fp32"), (0, "bf16"), (1, "bf16")]
    ranks = run_distributed(_skip_worker, 2, layouts, str(tmp_path / "ds"))
    assert ranks[0] == ranks[1] or all(ranks[0][k] == ranks[1][k] for k in ranks[0] if "health" not in k)
    res = ranks[0]
    for stage, precision in layouts:
        key = f"z{stage}-{precision}"
        print(f"\n{key}: " + ", ".join(f"{k.split('/')[1]}={res[k]}" for k in res
                                        if k.startswith(key + "/") and "health" not in k))
        for check in ("first_skip_unchanged", "skip_unchanged", "nan_seen", "nan_unchanged", "same_as_never_seen"):
            assert res[f"{key}/{check}"] is True, (key, check)
        health = res[f"{key}/health"]
        assert health["health/grad_norm"] == pytest.approx(res[f"{key}/grad_norm"], rel=1e-4)
        assert health["health/nonfinite_grads"] == 0 and 0 < health["health/update_ratio"] < 1
        assert {"health/act_rms/block01", "health/act_max/block01", "health/attn_logit_max",
                "health/logit_ms", "health/param_norm/block01"} <= set(health)
    assert res["restore_exact"] is True and res["nan_checkpoint_refused"] is True
    ref = res["z1-fp32/health"]
    print("health metrics (ZeRO-1):", {k: round(v, 5) for k, v in ref.items()})
    for stage in (0, 2, 3):  # the same numbers whatever the stage holds where
        other = res[f"z{stage}-fp32/health"]
        for k in ("health/grad_norm", "health/param_norm", "health/update_ratio", "health/grad_norm/block01",
                  "health/act_rms/block01", "health/attn_logit_max"):
            assert other[k] == pytest.approx(ref[k], rel=1e-4), (stage, k)


# ----------------------------------------------------------------------------------------------
# Fault injection in real 2-worker training (the real train_loop on real gloo ranks)
# ----------------------------------------------------------------------------------------------

TINY = ["model.num_layers=2", "model.hidden_size=64", "model.num_heads=4", "model.num_kv_heads=2",
        "model.max_seq_len=32", "data.tokenizer_vocab_size=512", "data.tokenizer_train_docs=3000",
        "data.num_streams=2", "train.global_batch_size=8", "train.micro_batch_size=4", "train.max_steps=24",
        "train.warmup_steps=2", "train.decay=constant", "train.log_every=1", "train.val_every=0",
        "train.val_sequences=8", "checkpoint.every_steps=4", "cluster.num_workers=2", "cluster.use_ray=false",
        "stability.window=16", "stability.warmup_steps=6", "stability.good_after_steps=2",
        "stability.health_every=4", "stability.lr_cooldown_steps=4", "stability.max_consecutive_skips=3",
        "stability.plot_at_end=false"]


def _history(run_id: str, key: str = "train/loss") -> dict[int, float]:
    from mlflow import MlflowClient

    client = MlflowClient()
    return {m.step: m.value for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.timestamp)}


def _all_finite(root: Path) -> tuple[int, list[str]]:
    """(tensors checked, files holding NaN/Inf) over every checkpoint file under ``root``."""
    checked, bad = 0, []

    def walk(x, f):
        nonlocal checked
        if torch.is_tensor(x):
            checked += 1
            if x.is_floating_point() and not torch.isfinite(x).all():
                bad.append(f)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v, f)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v, f)
    for f in sorted(root.rglob("*.pt")):
        walk(torch.load(f, map_location="cpu", weights_only=False), str(f))
    return checked, bad


@pytest.fixture(scope="module")
def fault_runs(tmp_path_factory):
    """Four real 2-worker runs of 24 steps in one pair of processes: clean, NaN gradient on rank 1 at
    step 5 (policy skip), LR x1000 at step 13 (policy rollback), and the rollback run resumed from its
    step-8 checkpoint (before the fault)."""
    from pretrain.driver.prepare import prepare_new

    with in_workdir(tmp_path_factory.mktemp("stability")) as work:
        clean = prepare_new(load_config(ROOT / "configs" / "demo-decoder.yaml", TINY))
        tok = [f"data.tokenizer={Path(clean.run_dir) / 'tokenizer'}"]
        nan = prepare_new(load_config(ROOT / "configs" / "demo-decoder.yaml",
                                      TINY + tok + ["stability.policy=skip", "faults.nan_grad_at_step=5"]))
        spike_over = TINY + tok + ["stability.policy=rollback", "faults.loss_spike_at_step=13"]
        spike = prepare_new(load_config(ROOT / "configs" / "demo-decoder.yaml",
                                        spike_over + ["stability.plot_at_end=true"]))
        resumed = prepare_new(load_config(ROOT / "configs" / "demo-decoder.yaml", spike_over))
        # resumes from a checkpoint the spike run writes first in the same processes (the driver's preflight
        # would refuse a checkpoint.resume_from that does not exist yet, so it is set on the prepared job)
        resumed.config["checkpoint"] = {**resumed.config["checkpoint"],
                                        "resume_from": str(Path(spike.run_dir) / "step_00000008")}
        jobs = [clean, nan, spike, resumed]
        ranks = run_distributed(train_jobs, 2, [asdict(j) for j in jobs], timeout=900)
        yield {"work": work, "jobs": dict(zip(("clean", "nan", "spike", "resumed"), jobs)), "ranks": ranks,
               "final": dict(zip(("clean", "nan", "spike", "resumed"), ranks[0]))}


@pytest.mark.slow
def test_nan_gradient_on_one_rank_is_skipped_on_all_ranks(fault_runs):
    clean, nan = fault_runs["final"]["clean"], fault_runs["final"]["nan"]
    timelines = [r[1]["stability"]["timeline"] for r in fault_runs["ranks"]]
    print("\nNaN run events (rank 0):", timelines[0])
    assert timelines[0] == timelines[1], "every rank must decide the same"
    assert [(e["step"], e["kind"], e["action"]) for e in timelines[0]] == [(5, "nonfinite", "skip")]
    assert nan["stability"]["skipped_steps"] == 1 and nan["step"] == 24
    rel = abs(nan["final_train_loss"] - clean["final_train_loss"]) / clean["final_train_loss"]
    rel_val = abs(nan["val_loss"] - clean["val_loss"]) / clean["val_loss"]
    print(f"final train loss: clean {clean['final_train_loss']:.4f}, NaN-skipped {nan['final_train_loss']:.4f} "
          f"({100 * rel:.2f}%); val loss {clean['val_loss']:.4f} vs {nan['val_loss']:.4f} ({100 * rel_val:.2f}%)")
    assert rel < 0.05 and rel_val < 0.05
    with_health = _history(fault_runs["jobs"]["nan"].run_id, "health/grad_norm/block01")
    assert sorted(with_health) == [4, 8, 12, 16, 20, 24]


@pytest.mark.slow
def test_loss_spike_rolls_back_skips_the_data_window_and_finishes_finite(fault_runs):
    spike = fault_runs["final"]["spike"]
    events = spike["stability"]["timeline"]
    assert events == fault_runs["ranks"][1][2]["stability"]["timeline"]
    print("\nspike run events:", [(e["step"], e["kind"], e["action"], e["detail"]) for e in events])
    kinds = [(e["step"], e["kind"], e["action"]) for e in events]
    assert kinds[0] == (14, "loss_spike", "rollback"), kinds
    rb = events[1]
    # Checkpoint 12 saw only one healthy step before the spike: the newest good one is step 8.
    assert (rb["kind"], rb["to_step"], rb["data_window"]) == ("rollback", 8, [8 * 8, 14 * 8])
    assert spike["stability"]["skipped_windows"] == [[64, 112]] and spike["stability"]["rollbacks"] == 1
    assert spike["step"] == 24 and math.isfinite(spike["final_train_loss"]) and math.isfinite(spike["val_loss"])
    run_dir = Path(fault_runs["jobs"]["spike"].run_dir)
    state = json.loads((run_dir / "step_00000024" / "trainer_state.json").read_text())
    assert state["sequences"] == (24 + 6) * 8 and state["callbacks"]["faults_fired"] == {"fired": ["loss_spike"]}
    assert [Path(p).parent.name for p in rb["abandoned"]] == ["abandoned"]  # the old step_12
    from mlflow import MlflowClient

    client, run_id = MlflowClient(), fault_runs["jobs"]["spike"].run_id
    run = client.get_run(run_id)
    assert run.data.metrics["stability/events"] == 2 and run.data.metrics["stability/rollbacks"] == 1
    assert run.data.tags["pretrain.stability.last_event"] == "step 14: rollback -> restored"
    timeline = json.loads(Path(client.download_artifacts(run_id, "stability/timeline.json")).read_text())
    assert timeline["timeline"] == events and timeline["skipped_windows"] == [[64, 112]]
    losses = _history(fault_runs["jobs"]["spike"].run_id)
    assert max(losses.values()) < 10 and sorted(losses) == list(range(1, 25))
    assert Path(spike["plot"]).is_file()
    for job in fault_runs["jobs"].values():  # every checkpoint ever written, abandoned ones included
        checked, bad = _all_finite(Path(job.run_dir))
        assert checked > 0 and not bad, bad


@pytest.mark.slow
def test_resume_through_a_rollback_is_bitwise(fault_runs):
    """Resumed from step 8 (before the injected spike): the same spike, the same rollback, the same
    skipped window and the same losses and final weights, bit for bit."""
    from pretrain.export.checkpoints import consolidated_state_dict

    spike, resumed = fault_runs["final"]["spike"], fault_runs["final"]["resumed"]
    def events(final: dict) -> list[dict]:  # without the paths, which name each run's own directory
        return [{k: v for k, v in e.items() if k not in ("checkpoint", "abandoned")}
                for e in final["stability"]["timeline"]]

    assert events(spike) == events(resumed) and len(events(spike)) == 2
    a, b = _history(fault_runs["jobs"]["spike"].run_id), _history(fault_runs["jobs"]["resumed"].run_id)
    print("\nrollback run:", {s: round(v, 5) for s, v in a.items() if s > 8},
          "\nresumed run: ", {s: round(v, 5) for s, v in b.items()})
    assert sorted(b) == list(range(9, 25)) and all(a[s] == b[s] for s in b)
    wa = consolidated_state_dict(Path(fault_runs["jobs"]["spike"].run_dir) / "step_00000024", zero_stage=1)
    wb = consolidated_state_dict(Path(fault_runs["jobs"]["resumed"].run_dir) / "step_00000024", zero_stage=1)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


# ----------------------------------------------------------------------------------------------
# Halt, through the CLI (one in-process worker), and the plot command
# ----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_halt_policy_stops_with_one_line_and_a_report_then_plot(tmp_path):
    args = [a.replace("cluster.num_workers=2", "cluster.num_workers=1") for a in TINY]
    proc = subprocess.run([PYTHON, "-m", "pretrain", "train", *args, "stability.policy=halt",
                           "faults.nan_grad_at_step=3"], cwd=tmp_path, env=cli_env(tmp_path),
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "stability halt at step 3: nonfinite" in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "[train] HALT:" in proc.stdout
    assert "stability event #1 at step 3: nonfinite -> halt" in proc.stdout
    run_id = next(line.split()[2].rstrip(":") for line in proc.stdout.splitlines()
                  if line.startswith("[pretrain] run "))
    report = json.loads((tmp_path / "checkpoints" / run_id / "stability_report.json").read_text())
    assert report["halted"]["step"] == 3 and report["policy"] == "halt"
    assert not list((tmp_path / "checkpoints" / run_id).glob("step_*"))  # nothing after step 0 was committed

    plot = subprocess.run([PYTHON, "-m", "pretrain", "runs", run_id, "--plot"], cwd=tmp_path,
                          env=cli_env(tmp_path), capture_output=True, text=True, timeout=120, check=False)
    assert plot.returncode == 0, plot.stderr[-2000:]
    path = Path(plot.stdout.strip().splitlines()[-1].split("plot: ", 1)[1])
    assert path.is_file() and path.stat().st_size > 10_000
    print("\n" + errors[0] + "\nplot:", path)
