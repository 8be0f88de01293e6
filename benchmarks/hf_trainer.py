"""The Hugging Face side of ``./launch.sh bench --vs-hf``: what a user would run instead of ``./launch.sh train``.

``python -m benchmarks.hf_trainer MODEL_DIR TOKENS.pt OUT_DIR [--steps ...]``: ``transformers.Trainer`` trains the model
saved in ``MODEL_DIR`` (``from_pretrained``) on the packed sequences in ``TOKENS.pt`` (an int64 tensor
``[sequences, seq_len]``, in training order: served in order, no shuffling, labels = inputs, the model shifts),
then saves the trained model to ``OUT_DIR`` (as our run writes its final checkpoint). ``--json-out`` gets the end
time of every step (``time.perf_counter``), the losses Trainer logged and the threads it trained with.

Deliberately imports none of our packages (the command's wall time is Trainer's own: torch, transformers,
accelerate) and sets only what the comparison fixes: the optimizer's hyper-parameters, the schedule, fp32, the CPU
and the thread count.
"""

from __future__ import annotations

import argparse
import json
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.hf_trainer")
    p.add_argument("model_dir")
    p.add_argument("tokens")
    p.add_argument("out_dir")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=0)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--betas", type=float, nargs=2, default=(0.9, 0.999))
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json-out", default="")
    a = p.parse_args(argv)

    import torch

    torch.set_num_threads(a.threads)
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    class Sequences(torch.utils.data.IterableDataset):
        """The packed sequences in order (an iterable dataset: Trainer neither samples nor shuffles it)."""

        def __init__(self, ids: torch.Tensor):
            self.ids = ids

        def __iter__(self):
            for row in self.ids:
                yield {"input_ids": row, "labels": row}

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_step_end(self, args, state, control, **kw):
            self.ends.append(time.perf_counter())

    ids = torch.load(a.tokens, weights_only=True)
    model = AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=torch.float32)
    args = TrainingArguments(
        output_dir=a.out_dir,
        max_steps=a.steps,
        per_device_train_batch_size=a.batch,
        learning_rate=a.lr,
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": a.min_lr_ratio},
        warmup_steps=a.warmup,
        weight_decay=a.weight_decay,
        adam_beta1=a.betas[0],
        adam_beta2=a.betas[1],
        adam_epsilon=a.eps,
        max_grad_norm=a.grad_clip,
        logging_steps=a.log_every,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=a.seed,
        dataloader_num_workers=0,
    )
    clock = Clock()
    trainer = Trainer(model=model, args=args, train_dataset=Sequences(ids), callbacks=[clock])
    trainer.train()
    trainer.save_model(a.out_dir)
    if a.json_out:
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        with open(a.json_out, "w") as f:
            json.dump(
                {
                    "step_ends": clock.ends,
                    "losses": losses,
                    "threads": torch.get_num_threads(),
                    "steps": trainer.state.global_step,
                },
                f,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
