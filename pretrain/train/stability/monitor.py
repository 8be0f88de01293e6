"""Training-stability control: detectors, the policy decision and the event timeline.

A functional core (:class:`StabilityMonitor`: no tensors, files or process groups); the loop's thin impure shell
is :class:`pretrain.train.stability.control.StabilityControl` (progress lines, MLflow, rollbacks). The step hands
:meth:`StabilityMonitor.decide` the *all-reduced* loss and gradient norm of one step before the
optimizer step, so every rank makes the same decision from the same inputs and the same (checkpointed)
state; the loop carries the decision out (skip the update, roll back, halt).

Detectors
    * non-finite loss or gradient (NaN/Inf) — always on;
    * loss and gradient-norm spikes: ``(x - median) / (1.4826 * MAD)`` over a rolling window of recent
      finite values above ``spike_threshold`` (robust statistics: the outliers they look for do not
      move them), after ``warmup_steps``;
    * slow divergence: the least-squares loss trend over ``divergence_window`` healthy steps rising by
      more than ``divergence_threshold`` of the mean loss.

Actions per ``stability.policy`` (the event kind -> action table is :data:`ACTIONS`)
    * ``log``: record only;
    * ``skip``: drop the update of a non-finite or spiking step; after ``max_consecutive_skips`` skips
      in a row, halt (skipping is not helping);
    * ``rollback``: skip non-finite steps (one bad batch says nothing about the weights); a spike,
      a divergence or too many consecutive skips restore the newest *good* checkpoint (one followed by
      ``good_after_steps`` healthy steps), continue from the current data position and cool the LR down;
      more than ``max_rollbacks`` rollbacks halt;
    * ``halt``: stop at the first event with a one-line reason and a JSON report.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from pretrain.config import MoEConfig, StabilityConfig

ROBUST_SIGMA = 1.4826  # MAD -> standard deviation for normal data
MIN_HISTORY = 8  # values a rolling statistic needs before it may call a spike
MIN_REL_SIGMA = 0.01  # sigma floor, relative to the median: a near-constant series must not make noise a spike
TIMELINE_LIMIT = 1000  # events kept in the state (the total is counted separately)
REPORT_FILE = "stability_report.json"  # in the run directory, written on a halt
TAG_LAST_EVENT = "pretrain.stability.last_event"

# What each event kind does under each policy.
ACTIONS: dict[str, dict[str, str]] = {
    "log": {"nonfinite": "log", "loss_spike": "log", "grad_spike": "log", "divergence": "log"},
    "skip": {"nonfinite": "skip", "loss_spike": "skip", "grad_spike": "skip", "divergence": "log"},
    "rollback": {"nonfinite": "skip", "loss_spike": "rollback", "grad_spike": "rollback", "divergence": "rollback"},
    "halt": {"nonfinite": "halt", "loss_spike": "halt", "grad_spike": "halt", "divergence": "halt"},
}


class StabilityHaltError(RuntimeError):
    """Training stopped by the stability policy; the message is one line, ``report`` the details."""

    def __init__(self, line: str, report: dict[str, Any] | None = None):
        super().__init__(line)
        self.report = report or {}

    def __reduce__(self):  # Ray ships worker exceptions to the driver by pickling
        return type(self), (str(self), self.report)


@dataclass(frozen=True)
class StepSignals:
    """The inputs of one decision, identical on every rank (reduced across ranks by the step)."""

    step: int
    """1-based number of the step being decided."""
    loss: float
    """Mean loss over all ranks and micro-batches."""
    grad_norm: float
    """Global pre-clipping gradient norm."""

    @property
    def finite(self) -> bool:
        return math.isfinite(self.loss) and math.isfinite(self.grad_norm)


@dataclass(frozen=True)
class Decision:
    """What to do with one step. ``apply``: whether its update is applied."""

    action: str
    """``ok``, ``log``, ``skip``, ``rollback`` or ``halt``."""
    event: dict[str, Any] | None = None
    """The timeline entry of the event, if any."""

    @property
    def apply(self) -> bool:
        return self.action in ("ok", "log")


def _num(x: float) -> float | str:
    """JSON-safe number: non-finite values as strings ("nan", "inf")."""
    return x if math.isfinite(x) else str(x)


def robust_z(value: float, history: list[float]) -> float | None:
    """Robust z-score of ``value`` against ``history`` (None with fewer than MIN_HISTORY values)."""
    if len(history) < MIN_HISTORY:
        return None
    med = statistics.median(history)
    mad = statistics.median(abs(x - med) for x in history)
    sigma = max(ROBUST_SIGMA * mad, MIN_REL_SIGMA * abs(med), 1e-12)
    return (value - med) / sigma


def trend_rise(values: list[float]) -> float:
    """Least-squares rise over the series, relative to its mean: slope * (n - 1) / mean."""
    n = len(values)
    mean_x, mean_y = (n - 1) / 2.0, sum(values) / n
    sxx = sum((i - mean_x) ** 2 for i in range(n))
    sxy = sum((i - mean_x) * (y - mean_y) for i, y in enumerate(values))
    return (sxy / sxx) * (n - 1) / abs(mean_y) if sxx > 0 and mean_y != 0 else 0.0


@dataclass
class _State:
    """Everything that must survive a restart (saved in ``trainer_state.json``)."""

    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    trend: list[float] = field(default_factory=list)
    consecutive_skips: int = 0
    skipped_steps: int = 0
    rollbacks: int = 0
    events_total: int = 0
    last_event_step: int = 0
    cooldown_until: int = 0
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    """Committed checkpoints of this lineage: step, path, sequences, healthy (steps since), good, tainted."""
    skipped_windows: list[list[int]] = field(default_factory=list)
    """Data windows [from_sequence, to_sequence) given up by rollbacks."""
    timeline: list[dict[str, Any]] = field(default_factory=list)
    collapse_streaks: dict[str, int] = field(default_factory=dict)
    """MoE block index -> consecutive steps in which one expert took more than ``moe.collapse_share``."""


class StabilityMonitor:
    """Detectors + policy + timeline. Same inputs and state give the same decisions on every rank."""

    def __init__(self, cfg: StabilityConfig, moe: MoEConfig | None = None):
        self.cfg = cfg
        self.moe = moe if moe is not None else MoEConfig()
        self.s = _State()

    # -- the decision ---------------------------------------------------------------------------

    def decide(self, sig: StepSignals) -> Decision:
        """Classify one step and pick the action; updates the statistics and counters."""
        cfg, s = self.cfg, self.s
        kind, detail = self._detect(sig)
        if kind is None:
            s.consecutive_skips = 0
            self._healthy_step()
            return Decision("ok")
        action = ACTIONS[cfg.policy][kind]
        if kind != "nonfinite":
            self._taint_pending()
        if action == "skip":
            s.consecutive_skips += 1
            if s.consecutive_skips >= cfg.max_consecutive_skips:  # the N-th bad step in a row escalates
                action = "rollback" if cfg.policy == "rollback" else "halt"
                detail += f"; {s.consecutive_skips} consecutive bad steps"
            else:
                s.skipped_steps += 1  # (an escalated step is not skipped)
        else:
            s.consecutive_skips = 0
        if action == "rollback":
            if s.rollbacks >= cfg.max_rollbacks:
                action, detail = "halt", detail + f"; rollback limit {cfg.max_rollbacks} reached"
            elif self.rollback_target() is None:
                action, detail = "halt", detail + "; no good checkpoint to roll back to"
        event = self._record(sig.step, kind, action, detail, loss=_num(sig.loss), grad_norm=_num(sig.grad_norm))
        return Decision(action, event)

    def _detect(self, sig: StepSignals) -> tuple[str | None, str]:
        cfg, s = self.cfg, self.s
        if not sig.finite:
            what = "loss" if not math.isfinite(sig.loss) else "gradient"
            return "nonfinite", f"non-finite {what}: loss {sig.loss:.4g}, grad norm {sig.grad_norm:.4g}"
        active = sig.step > cfg.warmup_steps
        z_loss = robust_z(sig.loss, s.losses) if active else None
        z_grad = robust_z(sig.grad_norm, s.grad_norms) if active and cfg.detect_grad_spikes else None
        # Every finite value enters the windows: median/MAD shrug off the outliers they flag, and a
        # genuine level shift is absorbed instead of being flagged forever.
        s.losses = (s.losses + [sig.loss])[-cfg.window :]
        s.grad_norms = (s.grad_norms + [sig.grad_norm])[-cfg.window :]
        if z_loss is not None and z_loss > cfg.spike_threshold:
            return "loss_spike", (
                f"loss {sig.loss:.4g} is {z_loss:.1f} robust sigmas above the window median "
                f"(grad norm {sig.grad_norm:.4g})"
            )
        if z_grad is not None and z_grad > cfg.spike_threshold:
            return "grad_spike", (
                f"grad norm {sig.grad_norm:.4g} is {z_grad:.1f} robust sigmas above the window "
                f"median (loss {sig.loss:.4g})"
            )
        if cfg.divergence_window and active:
            s.trend = (s.trend + [sig.loss])[-cfg.divergence_window :]
            if len(s.trend) == cfg.divergence_window:
                rise = trend_rise(s.trend)
                if rise > cfg.divergence_threshold:
                    s.trend = []  # fire once per window
                    return "divergence", (
                        f"loss trend rose {100 * rise:.1f}% over the last {cfg.divergence_window} healthy steps"
                    )
        return None, ""

    def _record(self, step: int, kind: str, action: str, detail: str, **extra: Any) -> dict[str, Any]:
        s = self.s
        s.events_total += 1
        s.last_event_step = step
        event = {"step": step, "kind": kind, "action": action, "detail": detail, "event": s.events_total, **extra}
        s.timeline = (s.timeline + [event])[-TIMELINE_LIMIT:]
        return event

    def router_collapse(self, step: int, max_shares: dict[int, float]) -> list[dict[str, Any]]:
        """Flag (policy ``log``: the router is not broken by one step, and rollback would not change it) each
        MoE block whose busiest expert took more than ``moe.collapse_share`` of the tokens for
        ``moe.collapse_steps`` consecutive steps; once per streak. ``max_shares``: block -> busiest share
        (:func:`pretrain.model.moe.max_shares`). Nothing with ``top_k == num_experts``: every expert takes every
        token."""
        events: list[dict[str, Any]]
        m, streaks, events = self.moe, self.s.collapse_streaks, []
        if not m.collapse_steps or 0 < m.num_experts <= m.top_k:
            return events
        for block, share in sorted(max_shares.items()):
            key = str(block)
            streaks[key] = streaks.get(key, 0) + 1 if share > m.collapse_share else 0
            if streaks[key] == m.collapse_steps:
                events.append(
                    self._record(
                        step,
                        "router_collapse",
                        "log",
                        f"MoE block {block}: one expert took {100 * share:.1f}% of the "
                        f"tokens for {m.collapse_steps} consecutive steps (limit "
                        f"{100 * m.collapse_share:.0f}%)",
                        block=block,
                        share=share,
                    )
                )
        return events

    # -- checkpoints and rollback ----------------------------------------------------------------

    def _healthy_step(self) -> None:
        for c in self.s.checkpoints:
            if not c["good"] and not c["tainted"]:
                c["healthy"] += 1
                c["good"] = c["healthy"] >= self.cfg.good_after_steps
        self._forget()

    def _forget(self) -> None:
        """Keep the newest good checkpoint and the pending ones; older good and tainted ones are no target."""
        target = self.rollback_target()
        self.s.checkpoints = [c for c in self.s.checkpoints if c is target or (not c["good"] and not c["tainted"])]

    def _taint_pending(self) -> None:
        """A spike or divergence before a checkpoint proved itself: that checkpoint is never a target."""
        for c in self.s.checkpoints:
            if not c["good"]:
                c["tainted"] = True
        self._forget()

    def note_checkpoint(self, step: int, path: str, sequences: int) -> None:
        """A checkpoint was committed (or resumed from); it becomes good after healthy steps."""
        self.s.checkpoints = [c for c in self.s.checkpoints if c["step"] != step and c["path"] != path]
        self.s.checkpoints.append(
            {
                "step": step,
                "path": path,
                "sequences": sequences,
                "healthy": 0,
                "good": self.cfg.good_after_steps == 0,
                "tainted": False,
            }
        )
        self._forget()

    def restart(self, moe: MoEConfig | None = None) -> None:
        """The model changed (it grew): no rollback to checkpoints written so far (another architecture), and the
        rolling loss and gradient-norm statistics start over (the old model's scale says nothing about the new
        one's; spikes are detected again once the windows hold enough values). ``moe``: the grown model's (an
        upcycling gives a dense model experts): the router-collapse check follows it, its streaks started over (a
        depth growth renumbers the blocks)."""
        self.s.checkpoints = []
        self.s.losses, self.s.grad_norms, self.s.trend = [], [], []
        self.s.consecutive_skips = 0
        if moe is not None:
            self.moe = moe
        self.s.collapse_streaks = {}

    def rollback_target(self) -> dict[str, Any] | None:
        """The newest good checkpoint (a dict: step, path, sequences), or None."""
        good = [c for c in self.s.checkpoints if c["good"]]
        return max(good, key=lambda c: c["step"]) if good else None

    def protected_paths(self) -> set[str]:
        """Checkpoints pruning must keep under policy ``rollback`` (no other policy rolls back): the current rollback
        target and every checkpoint still proving itself (neither good nor tainted yet), which may become the target
        once it has seen ``good_after_steps`` healthy steps."""
        if self.cfg.policy != "rollback":
            return set()
        target = self.rollback_target()
        return {c["path"] for c in self.s.checkpoints if c is target or not (c["good"] or c["tainted"])}

    def rolled_back(
        self, step: int, target: dict[str, Any], from_sequence: int, to_sequence: int, abandoned: list[str]
    ) -> dict[str, Any]:
        """Book a rollback done at ``step`` to ``target``; the data window [from, to) is skipped."""
        cfg, s = self.cfg, self.s
        s.rollbacks += 1
        s.consecutive_skips = 0
        s.trend = []
        s.checkpoints = [c for c in s.checkpoints if c["step"] <= target["step"]]
        s.skipped_windows.append([from_sequence, to_sequence])
        if cfg.lr_cooldown_steps and cfg.lr_cooldown_factor < 1.0:
            s.cooldown_until = target["step"] + cfg.lr_cooldown_steps
        event = self._record(
            step,
            "rollback",
            "restored",
            f"restored step {target['step']}; skipped sequences [{from_sequence}, {to_sequence})",
            to_step=target["step"],
            checkpoint=target["path"],
            data_window=[from_sequence, to_sequence],
            abandoned=abandoned,
            lr_factor=cfg.lr_cooldown_factor,
            cooldown_until=s.cooldown_until,
        )
        s.last_event_step = target["step"]  # step numbers restart there
        return event

    def nonfinite_weights(self, step: int) -> Decision:
        """The weights themselves are non-finite (found before a checkpoint commit): roll back or halt."""
        s = self.s
        self._taint_pending()
        action = "rollback" if self.cfg.policy == "rollback" else "halt"
        detail = "non-finite weights; checkpoint not written"
        if action == "rollback" and (s.rollbacks >= self.cfg.max_rollbacks or self.rollback_target() is None):
            action, detail = "halt", detail + "; no rollback possible"
        return Decision(action, self._record(step, "nonfinite_weights", action, detail))

    def lr_factor(self, step: int) -> float:
        """LR multiplier for the 1-based ``step`` (the post-rollback cool-down)."""
        return self.cfg.lr_cooldown_factor if step <= self.s.cooldown_until else 1.0

    # -- reporting -------------------------------------------------------------------------------

    def steps_since_event(self, step: int) -> int:
        return max(0, step - self.s.last_event_step)

    def counters(self) -> dict[str, float]:
        s = self.s
        return {
            "stability/events": float(s.events_total),
            "stability/skipped_steps": float(s.skipped_steps),
            "stability/rollbacks": float(s.rollbacks),
        }

    def summary(self) -> dict[str, Any]:
        s = self.s
        return {
            "policy": self.cfg.policy,
            "events": s.events_total,
            "skipped_steps": s.skipped_steps,
            "rollbacks": s.rollbacks,
            "skipped_windows": [list(w) for w in s.skipped_windows],
            "timeline": [dict(e) for e in s.timeline],
        }

    def halt(self, event: dict[str, Any]) -> StabilityHaltError:
        """The error to raise for a halting decision: one line, plus a JSON-ready report."""
        line = f"stability halt at step {event['step']}: {event['kind']} ({event['detail']}) [policy {self.cfg.policy}]"
        report = {"halted": event, "config": asdict(self.cfg), **self.summary()}
        return StabilityHaltError(line, report)

    # -- state -----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return asdict(self.s)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.s = _State(**state) if state else _State()


def event_line(event: dict[str, Any]) -> str:
    """One progress line for an event."""
    return (
        f"stability event #{event['event']} at step {event['step']}: {event['kind']} -> {event['action']} "
        f"({event['detail']})"
    )
