"""Downstream tasks (``eval.tasks``): :func:`task_metrics` scores multiple-choice and cloze examples
(pretrain/data/tasks.py) with the one scorer, in training on all ranks (:class:`TaskEvaluation`, every
``eval.every`` steps) and offline in ``./launch.sh eval RUN_ID --tasks ...``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from pretrain.config import RunPlan
from pretrain.data.tasks import Task, choice_rows
from pretrain.model.score import IGNORE, Forward, score_batches
from pretrain.train import dist
from pretrain.train.callbacks.base import Callback
from pretrain.train.trainer import Trainer


@dataclass
class PreparedTask:
    """This rank's examples of one task, tokenized: per example, per choice, its scoring rows."""

    name: str
    cloze: bool
    rows: list[list[list[dict[str, torch.Tensor]]]]
    answers: list[int]
    choice_bytes: list[list[int]]

    @property
    def forwards(self) -> int:
        return sum(len(rows) for example in self.rows for rows in example)


def task_part(plan: RunPlan, rank: int) -> tuple[int, int]:
    """(``rank``, ``world``) of :func:`prepare_tasks` for worker ``rank``: its data-parallel rank and the number of
    data-parallel ranks. The workers of one sequence- or tensor-parallel group score the same examples (their forwards
    are collectives of the group), as they evaluate the same validation sequences (``RunPlan.val_part``)."""
    return plan.data_rank(rank), plan.world_size


def prepare_tasks(
    tasks: list[Task], tokenizer, kind: str, max_len: int, rank: int = 0, world: int = 1
) -> list[PreparedTask]:
    """Share ``rank`` of ``world`` (examples ``rank::world``) of every task, as scoring rows; in training the worker's
    data-parallel share (:func:`task_part`)."""
    out = []
    for task in tasks:
        mine = task.examples[rank::world]
        out.append(
            PreparedTask(
                task.name,
                task.cloze,
                [choice_rows(e, tokenizer, kind, max_len) for e in mine],
                [e.answer for e in mine],
                [[len(c.encode("utf-8")) for c in e.choices] for e in mine],
            )
        )
    return out


def _argmax(values: list[float]) -> int:
    return max(range(len(values)), key=lambda i: (values[i], -i))  # ties: the first, as numpy's argmax


def padded_forward(forward: Forward, multiple: int) -> Forward:
    """``forward`` of rows padded at the end to a multiple of ``multiple`` tokens (token 0 without a target: sequence
    parallelism splits every row into equal slices), its logits cut back to the row's length. A decoder's logits are
    those of the row without the padding (causal attention); an encoder's positions also attend the padding."""
    if multiple == 1:
        return forward

    def run(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        extra = -t % multiple
        if not extra:
            return forward(ids, labels)
        return forward(F.pad(ids, (0, extra), value=0), F.pad(labels, (0, extra), value=IGNORE))[:, :t]

    return run


@torch.no_grad()
def task_metrics(
    forward: Forward, tasks: list[PreparedTask], kind: str, device: torch.device, counted: bool = True
) -> dict[str, float]:
    """``eval/<task>/acc`` (and ``acc_norm`` for multiple-choice) over all ranks' examples. A choice's score is
    its log-likelihood, minus the summed nats the one scorer gives its rows (decoders: the continuation's
    log-probability given the context; encoders: the masked-LM pseudo-log-likelihood of its tokens);
    ``acc``: the answer has the highest score, ``acc_norm``: the highest score per UTF-8 byte of the choice
    (lm-evaluation-harness). Every rank runs as many forwards as the rank with the most rows (padding rows
    without targets). ``counted``: whether this rank's examples count (False on all but the first worker of a
    model-parallel group, whose workers score the same examples). Collective."""
    mine = sum(t.forwards for t in tasks)
    forwards = int(-dist.all_reduce_min([-float(mine)], device)[0])
    sums: list[float] = []
    for task in tasks:
        correct = correct_norm = 0.0
        for rows, answer, nbytes in zip(task.rows, task.answers, task.choice_bytes):
            scores = [-score_batches(forward, r, kind, device=device).nats for r in rows]
            correct += float(_argmax(scores) == answer)
            correct_norm += float(_argmax([s / max(b, 1) for s, b in zip(scores, nbytes)]) == answer)
        sums += [correct, correct_norm, float(len(task.answers))]
    if forwards > mine:  # keep the collectives of ZeRO-3 / expert-parallel forwards matched
        blank = {"input_ids": torch.zeros(1, 2, dtype=torch.long), "labels": torch.full((1, 2), -100)}
        score_batches(forward, [blank] * (forwards - mine), kind, device=device)
    if not counted:
        sums = [0.0] * len(sums)
    sums = dist.all_reduce_sum(sums, device)
    out: dict[str, float] = {}
    for i, task in enumerate(tasks):
        correct, correct_norm, n = sums[3 * i : 3 * i + 3]
        out[f"eval/{task.name}/acc"] = correct / max(n, 1.0)
        if not task.cloze:
            out[f"eval/{task.name}/acc_norm"] = correct_norm / max(n, 1.0)
    return out


class TaskEvaluation(Callback):
    """``eval.tasks`` every ``eval.every`` steps (0: every ``train.val_every`` steps) and at the last step, on all
    ranks (each scoring the examples of :func:`task_part`; rows padded for sequence parallelism)."""

    order = 42

    def __init__(self, tasks: list[PreparedTask], every: int) -> None:
        self.tasks, self.every = tasks, every
        self.done_at = -1
        self.last: dict[str, float] = {}

    name = "task_evaluation"  # a resume at a step that evaluated does not evaluate (and log) it again

    def on_rollback(self, trainer: Trainer) -> None:
        self.done_at = -1  # the run goes back: the steps ahead are new ones and evaluate again

    def state_dict(self) -> dict[str, Any]:
        return {"done_at": self.done_at, "last": dict(self.last)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.done_at, self.last = int(state.get("done_at", -1)), dict(state.get("last", {}))

    def run(self, trainer: Trainer) -> None:
        if not self.tasks or self.done_at == trainer.state.step:
            return
        self.done_at = trainer.state.step
        engine, plan = trainer.module.engine, trainer.plan
        engine.eval()
        try:
            self.last = task_metrics(
                padded_forward(lambda ids, labels: engine(ids, labels=labels).logits, plan.sequence_parallel),
                self.tasks,
                trainer.cfg.model.kind,
                trainer.module.device,
                counted=plan.shares_data(trainer.ctx.rank),
            )
        finally:
            engine.train()
        trainer.tracker.log_metrics(self.last, trainer.state.step)
        trainer.progress.say(
            f"step {trainer.state.step} tasks: "
            + ", ".join(f"{k[len('eval/') :]} {v:.3f}" for k, v in self.last.items())
        )

    def on_step_end(self, trainer: Trainer, result) -> None:
        step, t = trainer.state.step, trainer.cfg.train
        every = self.every or t.val_every
        if step == t.max_steps or (every and step % every == 0):
            self.run(trainer)

    def on_run_end(self, trainer: Trainer, final: dict) -> None:
        if 0 < trainer.state.step < trainer.cfg.train.max_steps:
            self.run(trainer)
        if self.last:
            final["tasks"] = dict(self.last)
