"""Stability monitoring and control in one process: detectors and policies (pure), model stabilizers, and the PNG.
The skip on real gloo ranks, halt through the CLI and DeepNorm training a deep post-LN model are in
``tests/integration/train/test_stability.py``; fault injection in real training in ``test_stability_faults.py``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from pretrain.config import ConfigError, ModelConfig, MoEConfig, StabilityConfig, load_config
from pretrain.train.stability.monitor import StabilityMonitor, StepSignals, robust_z, trend_rise
from tests.conftest import ROOT

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


@pytest.mark.parametrize(
    "policy, action", [("log", "log"), ("skip", "skip"), ("rollback", "rollback"), ("halt", "halt")]
)
def test_loss_spike_action_per_policy(policy, action):
    m = _monitor(policy=policy)
    assert all(d.action == "ok" for d in _feed(m, range(1, 30)))
    m.note_checkpoint(29, "/ckpt/29", 29 * 8)
    _feed(m, range(30, 33))  # 3 healthy steps: checkpoint 29 becomes good
    d = m.decide(StepSignals(33, 9.0, 1.0))
    assert d.action == action and d.event["kind"] == "loss_spike"
    assert d.apply == (action == "log")
    assert (
        m.decide(StepSignals(34, float("nan"), float("nan"))).action
        == {"log": "log", "skip": "skip", "rollback": "skip", "halt": "halt"}[policy]
    )


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
    assert [m.decide(nan).action for _ in range(3)] == ["skip", "skip", "halt"]  # the 3rd bad step in a row
    assert m.s.skipped_steps == 2 and m.s.timeline[-1]["detail"].endswith("; 3 consecutive bad steps")

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
    assert m.protected_paths() == {"/c/19", "/c/22"}  # 22 may become the target
    assert m.decide(StepSignals(25, 9.0, 1.0)).action == "rollback"
    _feed(m, range(26, 30))  # a spike tainted 22: never a target, however many healthy steps follow
    assert m.rollback_target()["step"] == 19 and [c["step"] for c in m.s.checkpoints] == [19]
    assert m.protected_paths() == {"/c/19"}


def _train_with_retention(m: StabilityMonitor, run_dir: Path, tokenizer: Path) -> list[str]:
    """40 healthy steps, a checkpoint every 10 with ``keep_last=1`` pruning outside what ``m`` protects (as the
    checkpoint callback does), the rollback target checked on disk at every step (policy ``rollback``); the
    checkpoints left."""
    from pretrain.checkpoint.writer import CheckpointWriter, Contents, FullWeights, LocalWorld

    cfg = load_config(None, [f"data.tokenizer={tokenizer}"])
    writer = CheckpointWriter(run_dir, LocalWorld(), "r", keep_last=1)
    for step in range(1, 41):
        m.decide(StepSignals(step, 3.0, 1.0))
        if step % 10 == 0:
            model = FullWeights({"a": torch.ones(2)})
            path = writer.save(Contents(cfg, {"step": step}, {}, model), m.protected_paths())
            writer.settle()
            m.note_checkpoint(step, str(path), 0)
        target = m.rollback_target()
        if m.cfg.policy == "rollback" and target is not None:  # (other policies never roll back)
            assert Path(target["path"]).is_dir(), f"step {step}: target {target['step']} pruned"
    return sorted(p.name for p in run_dir.iterdir())


def test_retention_keeps_the_checkpoints_that_may_become_the_rollback_target(tmp_path):
    """``checkpoint.keep_last`` with checkpoints more often than they become good: pruning keeps the pending ones,
    so each is on disk when it becomes the target; a policy that never rolls back protects none."""
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    m = _monitor(policy="rollback", good_after_steps=20)
    kept = _train_with_retention(m, tmp_path / "rollback", tmp_path / "tok")
    assert kept == ["step_00000020", "step_00000030", "step_00000040"]  # the target, and two still pending
    assert m.rollback_target()["step"] == 20
    skip = _monitor(policy="skip", good_after_steps=20)
    assert skip.protected_paths() == set()
    assert _train_with_retention(skip, tmp_path / "skip", tmp_path / "tok") == ["step_00000040"]


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
    for override, message in [
        ("stability.policy=undo", "stability.policy: expected one of log, skip"),
        ("stability.window=4", "stability.window: must be >= 8"),
        ("stability.spike_threshold=0", "stability.spike_threshold: must be > 0"),
        ("stability.lr_cooldown_factor=2", "stability.lr_cooldown_factor"),
        ("model.z_loss=-1", "model.z_loss: must be >= 0"),
        ("faults.nan_grad_at_step=x", "faults.nan_grad_at_step: expected int"),
    ]:
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


# ----------------------------------------------------------------------------------------------
# The picture
# ----------------------------------------------------------------------------------------------


def test_plot_training_png(tmp_path):
    from pretrain.train.plot import plot_training, split_replayed

    final, gone = split_replayed([(5, 1.0), (10, 0.9), (14, 143.0), (10, 0.95), (15, 0.8)])
    assert final == [(5, 1.0), (10, 0.95), (15, 0.8)] and gone == [[(10, 0.9), (14, 143.0)]]
    series = {
        "train/loss": [(s, 3 - 0.01 * s) for s in range(1, 15)]
        + [(15, 40.0)]
        + [(s, 3 - 0.011 * s) for s in range(9, 40)],
        "train/grad_norm": [(s, 1.0) for s in range(1, 40)],
        "val/loss": [(20, 2.8), (39, 2.6)],
    }
    events = [
        {"step": 5, "kind": "nonfinite", "action": "skip"},
        {"step": 15, "kind": "loss_spike", "action": "rollback"},
        {"step": 15, "kind": "rollback", "action": "restored", "to_step": 8},
    ]
    out = plot_training(series, events, tmp_path / "p.png", title="test")
    assert out.stat().st_size > 10_000 and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_router_collapse_is_flagged_once_per_streak():
    mon = StabilityMonitor(StabilityConfig(), MoEConfig(num_experts=4, collapse_share=0.8, collapse_steps=3))
    kinds = []
    for step, share in enumerate([0.9, 0.9, 0.5, 0.9, 0.9, 0.9, 0.95, 0.99], start=1):
        kinds += [(e["step"], e["kind"], e["action"]) for e in mon.router_collapse(step, {1: share, 3: 0.3})]
    assert kinds == [(6, "router_collapse", "log")]
    again = StabilityMonitor(StabilityConfig(), MoEConfig(num_experts=4, collapse_share=0.8, collapse_steps=3))
    again.load_state_dict(mon.state_dict())
    assert again.s.collapse_streaks == {"1": 5, "3": 0}


def test_stability_restarts_at_a_growth():
    from pretrain.config import StabilityConfig
    from pretrain.train.stability.monitor import StabilityMonitor, StepSignals

    mon = StabilityMonitor(StabilityConfig(warmup_steps=0, good_after_steps=0))
    for s in range(1, 20):
        mon.decide(StepSignals(s, 5.0 - s * 0.01, 1.0))
    mon.note_checkpoint(19, "/ckpt/step_19", 19 * 8)
    assert mon.rollback_target() is not None and len(mon.s.grad_norms) == 19
    mon.restart()
    assert mon.rollback_target() is None and mon.s.grad_norms == [] and mon.s.losses == []
    assert mon.decide(StepSignals(20, 9.0, 40.0)).action == "ok", "a new scale is no spike before a new window"
    # upcycled to 2 experts at top-2: every token goes to both (share 1.0), which is no collapse
    from pretrain.config import MoEConfig

    mon.restart(MoEConfig(num_experts=2, top_k=2))
    assert not [e for t in range(60) for e in mon.router_collapse(21 + t, {0: 1.0, 1: 1.0})]
