"""What ``eval`` evaluates (``eval/sources.py``): a checkpoint, and its export, carry the defaults of the run that
made it (its sequence length, seed, validation size and how it scored its tasks); a directory of another origin gets
the command's own."""

from __future__ import annotations

from eval.sources import open_source
from tests.unit.eval.test_evaluate import AGREE
from tests.unit.export.test_hf import (  # noqa: F401 - the autouse fixture is used by name
    one_thread,
    perturbed_state,
    small_run_config,
    write_checkpoint,
)


def test_a_checkpoint_brings_its_runs_defaults_and_an_export_the_commands(tokenizer_dir, workdir):
    extra = ["eval.max_examples=17", "eval.num_choices=3", "train.seed=5", "train.val_sequences=6"]
    cfg = small_run_config(workdir, tokenizer_dir, AGREE["llama-decoder"], extra)
    ckpt = write_checkpoint(workdir / "run", cfg, perturbed_state(cfg.model, seed=1), tokenizer_dir, 4)
    src = open_source(str(ckpt))
    assert src.tasks == {"max_examples": 17, "num_choices": 3}
    assert (src.seed, src.val_sequences, src.step, src.kind) == (5, 6, 4, "decoder")
    with src.hf_dir() as hf:  # the checkpoint written as a bare directory for tools that read one: no run metadata
        exported = open_source(str(hf))
        assert exported.tasks == {"max_examples": 200, "num_choices": 4} and exported.kind == "decoder"
    from pretrain.cli import main

    assert main(["export", str(workdir / "run"), "--out", str(workdir / "hf")]) == 0  # our export: the run's
    exported = open_source(str(workdir / "hf"))
    assert exported.tasks == {"max_examples": 17, "num_choices": 3}
    assert (exported.seed, exported.val_sequences) == (5, 6)
