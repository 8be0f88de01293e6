"""``train --dry-run`` (``pretrain/driver/dry_run.py``): what its plan says, and refusals as one line (exit 2)."""

from __future__ import annotations

from pretrain.cli import main


def test_a_run_without_held_back_data_is_planned_without_validation(workdir, capsys):
    assert main(["train", f"data.cache_dir={workdir / 'cache'}", "data.val_holdout=0", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "; validation: none\n" in out
    assert "no validation (data.val_holdout is 0 and data.val_sources is empty)" in out
    assert "validation every" not in out


def test_a_growth_that_cannot_apply_under_a_budget_is_one_line(workdir, capsys):
    """With ``train.max_flops`` the budget is resolved over the growth stages: a growth that cannot apply is refused
    in one line naming its entry, never a traceback."""
    args = ["train", f"data.cache_dir={workdir / 'cache'}", "growth.schedule=[{width: 1.5x}]", "train.max_flops=1e13"]
    assert main([*args, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        "error: growth.schedule[0]: width_op tile needs integer factors: hidden size 256 -> 384 (use width_op net2net)"
    ]
