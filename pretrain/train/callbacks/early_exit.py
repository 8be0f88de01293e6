"""Early-exit training in the loop (``layer_drop.early_exit``; the schedule and the loss are pure functions in
``pretrain/model/early_exit.py``): the exits of every training forward, and after every validation each exit's
held-out quality, logged to MLflow as

* ``val/exit_<E>/loss``: the mean cross-entropy (nats) of exit E (the first E blocks, then the shared final norm
  and LM head) over the validation set's predicted tokens, token-weighted as ``val/loss``;
* ``val/exit_<E>/acceptance``: the fraction of those positions where exit E's greedy token equals the full
  model's greedy token. Under greedy self-speculative decoding a drafted token is accepted exactly when the two
  agree, so this is the expected per-token acceptance of a draft from exit E, measured with the validation text
  as the prefix (teacher-forced) rather than the model's own continuation;
* ``val/exit_<E>/speedup_bound``: the most greedy self-speculative decoding from exit E could gain over plain
  greedy at that acceptance, whatever decodes it (:func:`pretrain.model.early_exit.speedup_bound`): below 1,
  drafting from exit E cannot pay.
"""

from __future__ import annotations

from typing import Any

import torch

from pretrain.config import RunConfig
from pretrain.model.early_exit import Exits, active_exits, speedup_bound, validation_exits
from pretrain.model.score import IGNORE, targets
from pretrain.train import dist
from pretrain.train.callbacks.base import Callback
from pretrain.train.trainer import Trainer


@torch.no_grad()
def evaluate_exits(module, batches: list[dict[str, torch.Tensor]], exits: Exits, layers: int) -> dict[str, float]:
    """``val/exit_<E>/loss``, ``/acceptance`` and ``/speedup_bound`` of every exit of ``exits`` over all ranks'
    shares of ``batches`` (decoders of ``layers`` blocks). Like :func:`pretrain.train.step.evaluate`, every rank
    runs as many forwards as the rank with the most batches (the others pad with batches without targets) and the
    first of the ranks that score the same sequences counts them. Collective."""
    engine, device = module.engine, module.device
    forwards = int(-dist.all_reduce_min([-float(len(batches))], device)[0])
    if batches:
        first = batches[0]
        pad = {"input_ids": torch.zeros_like(first["input_ids"]), "labels": torch.full_like(first["labels"], IGNORE)}
        batches = batches + [pad] * (forwards - len(batches))
    sums = [0.0] * (3 * len(exits))  # per exit: nats, predicted tokens, tokens equal to the full model's
    engine.eval()
    try:
        for mb in batches:
            ids, labels = mb["input_ids"].to(device), mb["labels"].to(device)
            out = engine(ids, labels=labels, exits=exits)
            keep = targets(labels, causal=True) != IGNORE  # (B, T-1)
            n = float(keep.sum())
            full = out.logits[:, :-1].argmax(-1)  # (B, T-1): the full model's greedy tokens
            for j in range(len(exits)):
                sums[3 * j] += out.exit_losses[j].item() * n
                sums[3 * j + 1] += n
                sums[3 * j + 2] += float(((out.exit_tokens[j][:, :-1] == full) & keep).sum())
    finally:
        engine.train()
    plan = getattr(module, "plan", None)
    if plan is not None and not plan.shares_data(module.rank):
        sums = [0.0] * len(sums)
    sums = dist.all_reduce_sum(sums, device)
    metrics: dict[str, float] = {}
    for j, (depth, _) in enumerate(exits):
        nats, tokens, same = sums[3 * j : 3 * j + 3]
        metrics[f"val/exit_{depth}/loss"] = nats / max(tokens, 1.0)
        metrics[f"val/exit_{depth}/acceptance"] = acceptance = same / max(tokens, 1.0)
        metrics[f"val/exit_{depth}/speedup_bound"] = float(speedup_bound(acceptance, depth, layers)["speedup"])
    return metrics


class EarlyExitCallback(Callback):
    """The exits each training forward computes (a function of the 0-based step and the current depth, so a
    resumed run and a grown model follow the same schedule), and per-exit validation after every validation."""

    order = 6  # after growth (3) and layer dropout (5): the depth of the step is known
    name = "early_exit_window"  # the exits trained since the last logged step: a resume logs what the run would

    def __init__(self, cfg: RunConfig) -> None:
        self.ee = cfg.layer_drop.early_exit
        # the run's length the curriculum was planned for, kept in checkpoints: a resume that trains longer
        # (train.max_steps raised) does not switch off exits the run trains already (``gradual``)
        self.layers, self.max_steps = cfg.model.num_layers, cfg.train.max_steps
        self.exits: Exits = []
        self.trained, self.steps = 0, 0
        self.last: dict[str, float] = {}

    def on_step_start(self, trainer: Trainer | None, step: int) -> None:
        if trainer is not None:  # growth may have changed the depth
            self.layers = trainer.module.cfg.model.num_layers
        self.exits = active_exits(self.ee, self.layers, step - 1, self.max_steps)
        self.trained += len(self.exits)
        self.steps += 1

    def forward_kwargs(self, module, index: int) -> dict[str, Any]:
        return {"exits": self.exits} if self.exits else {}

    def on_validation(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        layers = trainer.module.cfg.model.num_layers
        exits = validation_exits(self.ee, layers)
        if not trainer.val_set or not exits:
            return
        self.last.clear()  # updated in place: the run's final dict holds it (a last validation may follow)
        self.last.update(evaluate_exits(trainer.module, trainer.val_set, exits, layers))
        trainer.tracker.log_metrics(self.last, trainer.state.step)
        trainer.progress.say(
            f"step {trainer.state.step} validation per exit (loss / acceptance / speed-up bound): "
            + ", ".join(
                f"E={d} {self.last[f'val/exit_{d}/loss']:.4f} / {self.last[f'val/exit_{d}/acceptance']:.3f} / "
                f"{self.last[f'val/exit_{d}/speedup_bound']:.2f}x"
                for d, _ in exits
            )
        )

    def state_dict(self) -> dict[str, Any]:
        return {"trained": self.trained, "steps": self.steps, "planned_steps": self.max_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.trained, self.steps = int(state["trained"]), int(state["steps"])
        self.max_steps = int(state.get("planned_steps", self.max_steps))  # (a checkpoint written before the key)

    def on_rollback(self, trainer: Trainer) -> None:
        self.trained, self.steps = 0, 0  # the window of the abandoned steps

    def extra_metrics(self) -> dict[str, float]:
        """Mean number of exits trained per step since the last log."""
        trained = self.trained / max(self.steps, 1)
        self.trained, self.steps = 0, 0
        return {"early_exit/trained_exits": trained}

    def on_run_end(self, trainer: Trainer, final: dict[str, Any]) -> None:
        final["val_exits"] = self.last  # the validation of a run that stops early comes later in this event
