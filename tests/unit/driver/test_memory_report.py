"""The verdict of the memory plan: the total against the named GPU's memory, and the single changes that would make
the run fit."""

from __future__ import annotations

from pretrain.config import load_config, make_plan
from pretrain.driver.memory_plan import GIB, count_parameters, layout_of, memory
from pretrain.driver.memory_report import verdict
from tests.conftest import ROOT


def test_the_verdict_names_what_to_change():
    base = ["cluster.use_gpu=yes", "cluster.num_workers=8", "data.num_streams=64", "model.vocab_size=32000"]
    cfg = load_config(ROOT / "configs" / "llama-1b.yaml", [*base, "cluster.gpu_type=H100-80GB"])
    counts = count_parameters(cfg)
    line = verdict(cfg, counts, layout_of(cfg, make_plan(cfg, 8)))
    assert line.startswith("H100-80GB: fits: ") and line.endswith(" of 80 GiB per GPU")
    tight = ["train.activation_checkpointing=none", "zero.stage=1", "cluster.gpu_type=L4-24GB"]
    cfg = load_config(ROOT / "configs" / "llama-1b.yaml", [*base, *tight])
    lay = layout_of(cfg, make_plan(cfg, 8))
    line = verdict(cfg, counts, lay)
    total = memory(cfg, counts, lay).total / GIB
    assert line.startswith(f"L4-24GB: does not fit: {total:.1f} of 24 GiB per GPU; to fit: ")
    assert "train.micro_batch_size=" in line and "train.activation_checkpointing=" in line
    cfg = load_config(None, ["cluster.use_gpu=yes", "model.vocab_size=4096"])
    assert verdict(cfg, count_parameters(cfg), layout_of(cfg, make_plan(cfg, 1))).startswith("no GPU type named")


def test_the_documented_example_is_what_the_dry_run_prints():
    """``docs/memory-plan.md``'s llama-1b example, row for row (a change to the plan changes the page with it)."""
    from pretrain.driver.memory_report import plan_rows

    page = (ROOT / "docs" / "memory-plan.md").read_text()
    example = page[page.index("## Example: llama-1b on H100-80GB") :].split("```")[1].splitlines()
    shown = example[example.index(next(x for x in example if x.startswith("  parallel"))) :]
    cfg = load_config(ROOT / "configs" / "llama-1b.yaml", ["cluster.gpu_type=H100-80GB"])
    cfg.model.vocab_size = cfg.data.tokenizer_vocab_size  # as the dry run resolves it (32,000)
    rows = plan_rows(cfg, make_plan(cfg, cfg.cluster.num_workers), count_parameters(cfg))
    assert [f"  {k:<12} {v}" for k, v in rows] == shown
