"""Quality per data source in the loop: after every validation, each source's own validation set is scored by
the one scorer (:func:`pretrain.train.step.evaluate`) and logged as ``val/<source>/loss`` (``ppl``, and
``bits_per_byte`` for decoders / ``mlm_acc`` for encoders) beside the aggregate ``val/*``.

The sets come from :func:`pretrain.data.source_validation_batches`: each ``data.val_sources`` entry, or each
training source's held-out share. With one source its set *is* the aggregate one, so its metrics are the
aggregate's (no extra forward). Like validation, every rank runs as many forwards per set as the rank with
the most batches (collectives matched); the aggregate ``val/loss`` is untouched.
"""

from __future__ import annotations

import torch

from pretrain.train.callbacks.base import Callback
from pretrain.train.step import evaluate
from pretrain.train.trainer import Trainer


class SourceValidation(Callback):
    order = 41  # right after ValidationCallback (40), inside its on_validation event

    def __init__(
        self,
        sets: dict[str, list[dict[str, torch.Tensor]]],
        only_source: str = "",
        byte_lengths: torch.Tensor | None = None,
    ) -> None:
        """``sets``: validation batches by source name (this rank's part); ``only_source``: the name of the
        single source whose set is the aggregate one (then ``sets`` is empty)."""
        self.sets, self.only_source, self.byte_lengths = sets, only_source, byte_lengths
        self.last: dict[str, float] = {}

    def on_validation(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        out: dict[str, float] = {}
        if self.only_source:
            out = {f"val/{self.only_source}/{k[len('val/') :]}": v for k, v in metrics.items()}
        for name, batches in self.sets.items():  # the same order on every rank: collectives match
            out.update(evaluate(trainer.module, batches, self.byte_lengths, prefix=f"val/{name}/"))
        if not out:
            return
        self.last = out
        trainer.tracker.log_metrics(out, trainer.state.step)
        if self.sets:
            trainer.progress.say(
                f"step {trainer.state.step} validation per source: "
                + ", ".join(
                    f"{k[len('val/') :]} {v:.4f}" for k, v in out.items() if k.endswith(("/loss", "/bits_per_byte"))
                )
            )

    def on_run_end(self, trainer: Trainer, final: dict) -> None:
        if self.last:
            final["val_per_source"] = dict(self.last)
