"""The one scorer (``pretrain/model/score.py``): growth's held-back check and ``./launch.sh eval`` give identical
numbers on the same batches; the sums reduce over ranks; one perplexity cap. Through a real DeepSpeed engine on a
gloo rank (training's validation too): ``tests/integration/growth/test_score.py``."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from eval.evaluate import score
from pretrain.config import load_config
from pretrain.model import build_model
from pretrain.model.score import PPL_CAP_NATS, ScoreSums, mean_cross_entropy, score_batches
from pretrain.train.callbacks.growth import held_back_loss
from pretrain.train.step import evaluate
from tests.harness import tiny_model

TINY = [*tiny_model(num_kv_heads=2, dropout=0.0)]


def _batches(kind: str, n: int = 3, micro: int = 2) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 101, (micro, 16), generator=g)
        labels = ids.clone()
        if kind == "encoder":  # MLM: targets at the selected positions only, where the input is masked (id 0)
            selected = torch.rand(ids.shape, generator=g) < 0.3
            labels[~selected] = -100
            ids = ids.masked_fill(selected, 0)
        else:
            labels[0, 5:9] = -100  # some positions without a target (e.g. padding)
        out.append({"input_ids": ids, "labels": labels})
    return out


@pytest.mark.parametrize("kind", ["decoder", "encoder"])
def test_validation_growth_check_and_eval_give_identical_numbers(kind):
    torch.manual_seed(0)
    cfg = load_config(None, [*TINY, f"model.kind={kind}"])
    model = build_model(cfg.model, 3, cfg.moe)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    batches = _batches(kind)
    # Training's validation (DeepSpeed's engine forward is the module's forward; one rank: no collectives).
    module = SimpleNamespace(engine=model, device=torch.device("cpu"), cfg=cfg)
    val = evaluate(module, batches)
    assert model.training, "evaluate puts the engine back in training mode"
    # Growth's held-back check: a fresh fp32 model from the full state dict.
    growth = held_back_loss(cfg, state, batches, torch.device("cpu"))
    # ./launch.sh eval: the checkpoint's model behind a logits function.
    evaluated = build_model(cfg.model, 0, cfg.moe, weights=state).eval()
    ev = score(lambda ids: evaluated(ids).logits, batches, kind)
    print(f"\n{kind}: validation {val}, growth check {growth!r}, eval {ev}")
    assert val["val/loss"] == growth == ev["loss"]
    assert val["val/ppl"] == ev["ppl"] == math.exp(ev["loss"])
    if kind == "encoder":
        assert val["val/mlm_acc"] == ev["mlm_acc"] and 0 <= ev["mlm_acc"] < 1
    # The per-batch definition is the model's own training loss, token-weighted.
    with torch.no_grad():
        model.eval()
        ref = [(float(model(b["input_ids"], labels=b["labels"]).loss), b["labels"]) for b in batches]
    counts = [float((lab[:, 1:] if kind == "decoder" else lab).ne(-100).sum()) for _, lab in ref]
    assert ev["tokens"] == sum(counts)
    assert ev["loss"] == sum(loss * n for (loss, _), n in zip(ref, counts)) / sum(counts)


def test_sums_reduce_over_ranks_and_bits_per_byte():
    """Two ranks' sums added up (what the all-reduce does) score like one rank holding every batch."""
    g = torch.Generator().manual_seed(1)
    logits = [torch.randn(2, 6, 11, generator=g) for _ in range(4)]
    batches = [{"input_ids": torch.randint(0, 11, (2, 6), generator=g)} for _ in range(4)]
    for b in batches:
        b["labels"] = b["input_ids"].clone()
    lookup = {id(b["input_ids"]): lg for b, lg in zip(batches, logits)}
    forward = lambda ids, labels: lookup[id(ids)]  # noqa: E731
    byte_lengths = torch.arange(11) % 4
    whole = score_batches(forward, batches, "decoder", byte_lengths)
    a, b = (
        score_batches(forward, batches[:2], "decoder", byte_lengths),
        score_batches(forward, batches[2:], "decoder", byte_lengths),
    )
    summed = ScoreSums.from_list([x + y for x, y in zip(a.as_list(), b.as_list())])
    assert summed.tokens == whole.tokens == 4 * 2 * 5
    m = summed.metrics("decoder", with_bytes=True)
    assert m["loss"] == pytest.approx(whole.metrics("decoder")["loss"], rel=1e-12)
    assert m["bits_per_byte"] == pytest.approx(summed.nats / (math.log(2) * summed.bytes), rel=1e-12)
    assert summed.bytes == sum(float(byte_lengths[b["labels"][:, 1:]].sum()) for b in batches)
    assert "bits_per_byte" not in whole.metrics("decoder"), "bits per byte only where byte counts are known"


def test_one_perplexity_cap_and_empty_data():
    assert ScoreSums(nats=2.0 * 10, tokens=10).metrics("decoder")["ppl"] == math.exp(2.0)
    capped = ScoreSums(nats=800.0 * 3, tokens=3).metrics("decoder")
    assert capped["loss"] == 800.0 and capped["ppl"] == math.exp(PPL_CAP_NATS) == math.exp(50.0)
    with pytest.raises(ValueError, match="no predicted tokens"):
        ScoreSums().metrics("decoder")
    assert ScoreSums().metrics("encoder", allow_empty=True) == {"loss": 0.0, "ppl": 1.0, "mlm_acc": 0.0}
    # A micro-batch without targets scores 0 (not NaN): it cannot poison a sum.
    assert mean_cross_entropy(torch.randn(1, 4, 5), torch.full((1, 4), -100), causal=True).item() == 0.0
