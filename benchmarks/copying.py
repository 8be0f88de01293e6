"""In-context copying: whether a decoder has learned to repeat what its context already holds (the induction circuit
of Olsson et al. 2022). At the sizes the studies train, a run that learns it ends a few tenths of a nat below one
that does not, more than most of the methods the studies compare cost or save; so a study reports it for every run
it compares, and a gap between two runs can be read against it.

The probe: ``sequences`` sequences of ``length`` tokens drawn uniformly from the vocabulary (seeded), each followed
by itself. Tokens 2 .. ``length`` of the first copy cannot be predicted from their context (uniform noise); the same
tokens in the second copy can be, by copying. Reported: the model's mean cross-entropy on each, and the difference
(``gain``: how much better the model predicts the second copy; near 0 for a model that does not copy).
"""

from __future__ import annotations

from typing import Any


def copying_probe(model: Any, vocab_size: int, sequences: int = 64, length: int = 48, seed: int = 0) -> dict:
    """The probe (module docstring) on ``model`` (a causal LM returning ``.logits``, e.g. a ``transformers``
    ``LlamaForCausalLM``) with tokens drawn from ``range(vocab_size)``. Returns {"first_copy", "second_copy",
    "gain"} in nats."""
    import torch
    import torch.nn.functional as F

    if length < 2 or sequences < 1:
        raise ValueError(f"copying_probe: needs length >= 2 and sequences >= 1, got {length} and {sequences}")
    x = torch.randint(0, vocab_size, (sequences, length), generator=torch.Generator().manual_seed(seed))
    ids = torch.cat([x, x], dim=1)
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(input_ids=ids.to(device)).logits.float().cpu()
    loss = F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")  # position t predicts t + 1
    first = loss[:, : length - 1].mean().item()  # tokens 2 .. length of the first copy
    second = loss[:, length:].mean().item()  # the same tokens of the second copy
    return {"first_copy": first, "second_copy": second, "gain": first - second}
