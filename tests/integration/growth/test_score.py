"""The one scorer (``pretrain/model/score.py``) through a real DeepSpeed engine on a gloo rank: training's
validation, growth's held-back check and ``./launch.sh eval`` give identical numbers on the same batches."""

from __future__ import annotations

import pytest
import torch

from eval.evaluate import score
from pretrain.config import load_config
from pretrain.model import build_model
from pretrain.train.callbacks.growth import held_back_loss
from pretrain.train.step import evaluate
from tests.unit.model.test_score import TINY, _batches


def _engine_paths(rank: int, world: int, kind: str) -> tuple[dict, float, dict]:
    """Training's validation through a real DeepSpeed engine, growth's check and eval on its full weights."""
    from pretrain.train.module import build_module

    torch.set_num_threads(1)
    cfg = load_config(
        None,
        [
            *TINY,
            f"model.kind={kind}",
            "train.precision=fp32",
            "zero.stage=1",
            "train.global_batch_size=8",
            "train.micro_batch_size=2",
            "data.num_streams=1",
        ],
    )
    module = build_module(cfg)
    state = module.full_state_dict()
    batches = _batches(kind)
    val = evaluate(module, batches)
    growth = held_back_loss(cfg, state, batches, torch.device("cpu"))
    model = build_model(cfg.model, 0, cfg.moe, weights=state).eval()
    ev = score(lambda ids: model(ids).logits, batches, kind)
    module.engine.destroy()
    return val, growth, ev


@pytest.mark.parametrize("kind", ["decoder", "encoder"])
def test_the_three_paths_agree_through_a_real_engine(kind):
    from tests.harness import run_distributed

    ((val, growth, ev),) = run_distributed(_engine_paths, 1, kind, fresh=False)
    assert val["val/loss"] == growth == ev["loss"] and val["val/ppl"] == ev["ppl"]
    assert val.get("val/mlm_acc") == ev.get("mlm_acc")
