"""Layer dropout in training: a callback that turns ``layer_drop`` into per-forward gates (pure functions in
``pretrain/model/layerdrop.py``) and reports how much of the model ran."""

from __future__ import annotations

from typing import Any

from pretrain import ds_adapter
from pretrain.config import RunConfig
from pretrain.model.layerdrop import Gates, base_rate, executed_blocks, inference_scales, training_gates
from pretrain.train.callbacks.base import Callback
from pretrain.train.step import StepResult
from pretrain.train.trainer import Trainer


class LayerDropCallback(Callback):
    """Gates for every training forward of a step: in ``layer`` mode the same for every micro-batch and every rank
    (a function of seed, step and layer); in ``sample`` mode per sample of each micro-batch, keyed by its global
    micro-batch id (the same on any worker count). Padding micro-batches get the gates of the first one."""

    order = 5  # before anything that looks at which blocks run this step
    name = "layer_drop_window"  # the executed blocks since the last logged step: a resume logs what the run would

    def __init__(self, cfg: RunConfig, rank: int, micro_ids: list[int]) -> None:
        self.ld, self.seed, self.layers = cfg.layer_drop, cfg.train.seed, cfg.model.num_layers
        self.micro_ids = micro_ids
        self.step = 0  # 0-based step being run
        self.gates: Gates | None = None
        self.executed: list[int] = list(range(self.layers))
        self.executed_sum = 0.0
        self.steps = 0

    def on_run_start(self, trainer: Trainer) -> None:
        # a resumed run's last trained step: the scales of a validation before its first step (a run that ends
        # at once, its data exhausted) are the checkpoint's, as eval and export of it use
        self.step = max(trainer.state.step - 1, 0)
        self.layers = trainer.module.cfg.model.num_layers

    def on_step_start(self, trainer: Trainer | None, step: int) -> None:
        self.step = step - 1
        if trainer is not None:  # growth may have changed the depth
            self.layers = trainer.module.cfg.model.num_layers
            self._validate_with(trainer, self.step)
        if self.ld.mode == "layer":
            self.gates = training_gates(self.ld, self.seed, self.step, self.layers)
            self.executed = executed_blocks(self.gates)
        else:
            self.gates, self.executed = None, list(range(self.layers))
        self.executed_sum += len(self.executed)
        self.steps += 1
        if trainer is not None:
            trainer.shared.skipped_blocks = frozenset(self.skipped_blocks())

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        if trainer.state.step >= trainer.cfg.train.max_steps:  # the last validation is the finished model's
            self._validate_with(trainer, self.step)

    def on_run_end(self, trainer: Trainer, final: dict[str, Any]) -> None:
        self._validate_with(trainer, self.step)  # a run that stops early is validated at its end, finished

    def _validate_with(self, trainer: Trainer, step: int | None) -> None:
        """``rho`` scaling: the scales of the model's eval forwards (validation) are the rho of Xiao and Zhu's
        eq. 95 (arXiv:2311.17633, sec. 4.2.4), the keep probability the weights are being trained under: 1 - r(step)
        at 0-based ``step`` (a ``linear`` or ``progressive`` schedule may not have reached the final rate yet): the
        last step trained's, also for the finished model, as ``eval``, export, prune and growth of its checkpoint
        use (:func:`pretrain.model.layerdrop.as_of`)."""
        if self.ld.scaling == "rho":
            trainer.module.model.branch_scales = inference_scales(self.ld, self.layers, step)

    def forward_kwargs(self, module, index: int) -> dict[str, Any]:
        if self.ld.mode == "layer":
            return {"gates": self.gates}
        mid = self.micro_ids[index] if index < len(self.micro_ids) else self.micro_ids[0]
        return {"gates": training_gates(self.ld, self.seed, self.step, self.layers, mid, module.plan.micro_batch)}

    def after_backward(self, module) -> None:
        """ZeRO-3 keeps each parameter's gradient partition from the last step in which it had a gradient and
        reuses it for a parameter that got none: zero the partitions of every parameter a skip left without one
        (a skipped sub-layer's; all of a skipped block's, post-norm and DeepNorm norms included), so it sees a
        zero gradient under every ZeRO stage (as ZeRO-1/2 and plain data parallelism give)."""
        if self.gates is None or module.zero_stage != 3:
            return
        blocks = module.model.blocks
        unused = {id(p) for i, (attn, ffn) in enumerate(self.gates) for p in blocks[i].skipped_parameters(attn, ffn)}
        if not unused:
            return
        for p, grad in ds_adapter.zero3_grad_partitions(module.engine.optimizer):
            if id(p) in unused:
                grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        return {"executed_sum": self.executed_sum, "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.executed_sum, self.steps = float(state["executed_sum"]), int(state["steps"])

    def on_rollback(self, trainer: Trainer) -> None:
        self.executed_sum, self.steps = 0.0, 0  # the window of the abandoned steps

    def skipped_blocks(self) -> set[int]:
        """Blocks that did no work in the current step (``layer`` mode)."""
        return set(range(self.layers)) - set(self.executed)

    def extra_metrics(self) -> dict[str, float]:
        """Mean executed blocks since the last log, and the schedule's current rate."""
        active = self.executed_sum / max(self.steps, 1)
        self.executed_sum, self.steps = 0.0, 0
        return {"train/active_layers": active, "layer_drop/rate": base_rate(self.ld, self.step)}
