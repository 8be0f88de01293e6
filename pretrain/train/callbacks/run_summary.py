"""The end of a run: bad-record totals, the unigram baseline and ``summary.json``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pretrain.checkpoint import layout
from pretrain.checkpoint.store import write_json
from pretrain.data.bad_records import BadRecords, summarize_bad_records
from pretrain.train import dist
from pretrain.train.callbacks.base import Callback
from pretrain.train.callbacks.speed import SpeedMonitor  # noqa: F401  (a standard callback; defined with the loop clock)
from pretrain.train.trainer import Trainer

SUMMARY_FILE = layout.SUMMARY


class RunSummary(Callback):
    """The end of the run: the bad records of every stream, gathered on rank 0 (collective), then on rank 0 the
    unigram baseline of the validation set (from the user's cache when it holds it) and the summary (MLflow
    ``summary.json`` and ``RUN_DIR/summary.json``)."""

    order = 200  # last: the summary holds what every other callback added to ``final``

    def __init__(self, tokenizer, run_id: str):
        self.tokenizer, self.run_id = tokenizer, run_id

    def on_run_end(self, trainer: Trainer, final: dict[str, Any]) -> None:
        from pretrain.data import cached_unigram_baseline_loss

        cfg, ctx, tracker, step = trainer.cfg, trainer.ctx, trainer.tracker, trainer.state.step
        final["run_id"] = self.run_id
        # every stream's counter once: from the first of the workers that read it (model-parallel peers read the same)
        mine = trainer.batches.bad_record_counters() if trainer.plan.shares_data(ctx.rank) else []
        gathered = dist.gather_object([c.state_dict() for c in mine])
        if not ctx.is_main:
            return
        counters = []
        for state in (st for part in gathered for st in part):
            counters.append(BadRecords(cfg.data.bad_records))
            counters[-1].load_state_dict(state)
        bad = summarize_bad_records(counters)
        final["bad_records"] = int(bad["total"])
        if trainer.val_set:
            final["unigram_val_loss"] = cached_unigram_baseline_loss(
                cfg.data,
                kind=cfg.model.kind,
                seq_len=cfg.model.max_seq_len,
                tokenizer=self.tokenizer,
                val_sequences=cfg.train.val_sequences,
                seed=cfg.train.seed,
            )
            tracker.log_metrics({"val/unigram_baseline_loss": final["unigram_val_loss"]}, step)
        if bad["total"]:
            trainer.progress.say(
                f"bad records skipped: {bad['total']} {bad['by_reason']}; first: {'; '.join(bad['examples'][:3])}"
            )
        tracker.log_metrics({"data/bad_records": float(bad["total"])}, step)
        tracker.log_json(bad, "data/bad_records.json")
        tracker.log_json(final, SUMMARY_FILE)
        write_json(Path(trainer.run_dir) / SUMMARY_FILE, final)
