"""Self-speculative decoding with ``transformers``' early exit (``generate(..., assistant_early_exit=E)``): whether a
model's class supports it, and what a decoding drafted and accepted (:mod:`eval.generate` defines the counts)."""

from __future__ import annotations

from typing import Any

import torch

from pretrain.config import ConfigError


def base_model(model):
    """The model's body (``transformers``' ``base_model``: the model itself where its class has none apart, as our
    remote-code classes)."""
    return getattr(model, model.base_model_prefix, model)


@torch.no_grad()
def layers_run_at(model, num_layers: int, early_exit: int) -> int:
    """How many of the model's ``num_layers`` blocks one forward pass runs while ``config.num_hidden_layers`` is
    ``early_exit`` (how ``transformers``' early-exit drafting truncates the model): ``early_exit`` for classes that
    honour it (Llama, Qwen, Mistral...), ``num_layers`` for those that ignore it."""
    base = base_model(model)
    blocks = next((m for m in base.children() if isinstance(m, torch.nn.ModuleList) and len(m) == num_layers), None)
    if blocks is None:
        return num_layers
    ran = [0]
    hooks = [b.register_forward_pre_hook(lambda *_: ran.__setitem__(0, ran[0] + 1)) for b in blocks]
    saved = base.config.num_hidden_layers
    base.config.num_hidden_layers = early_exit
    try:
        model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=model.device), use_cache=False)
    finally:
        base.config.num_hidden_layers = saved
        for h in hooks:
            h.remove()
    return ran[0]


def check_exit(model, num_layers: int, early_exit: int) -> None:
    """ConfigError unless 1 <= ``early_exit`` < ``num_layers`` (the model's depth) and the model's class drafts at
    that depth (it honours ``config.num_hidden_layers`` and generates with a KV cache)."""
    if not 1 <= early_exit < num_layers:
        raise ConfigError(
            f"generate --early-exit {early_exit}: must be at least 1 and below the model's depth "
            f"({num_layers} layers): the first E layers draft, all {num_layers} verify"
        )
    if not model.generation_config.use_cache:
        raise ConfigError(
            f"generate --early-exit: {type(model).__name__} generates without a KV cache, which self-speculative "
            f"decoding needs; a model that exports to a standard class (Llama family) supports it"
        )
    cache = getattr(model.generation_config, "cache_implementation", None)
    if cache not in (None, "dynamic"):
        raise ConfigError(
            f"generate --early-exit: the model's generation config asks for a {cache!r} KV cache, with which "
            f"transformers does not decode self-speculatively; remove cache_implementation from its "
            f"generation_config.json (a dynamic cache) to draft from its early layers"
        )
    ran = layers_run_at(model, num_layers, early_exit)
    if ran != early_exit:
        raise ConfigError(
            f"generate --early-exit: {type(model).__name__} ignores config.num_hidden_layers (ran {ran} of "
            f"{num_layers} layers asked to run {early_exit}), so transformers cannot draft from its early layers; "
            f"a model that exports to LlamaForCausalLM supports it"
        )


class DraftCounter:
    """Counts the model's forward passes by depth while it is installed (a forward pre-hook): passes below full depth
    are drafting (one drafted token each), full-depth passes verify (:mod:`eval.generate`). A verification pass reads
    the drafts it checks as its last input tokens: :meth:`accepted` compares them with the decoded tokens."""

    def __init__(self, model, num_layers: int):
        self.base = base_model(model)
        self.num_layers = num_layers
        self.drafted = 0
        self.verified = 0
        self.rounds: list[list[int]] = []  # each verification's drafts
        self._since = 0  # draft passes since the last verification
        self._hook = model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        if self.base.config.num_hidden_layers < self.num_layers:
            self.drafted += 1
            self._since += 1
            return
        self.verified += 1
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.rounds.append(ids[0, ids.shape[1] - self._since :].tolist() if self._since and ids is not None else [])
        self._since = 0

    def accepted(self, new: list[int]) -> int:
        """Drafted tokens kept in ``new`` (the decoded tokens): each round keeps the longest prefix of its drafts that
        the output holds, then adds the full model's own token (none after a drafted end-of-text token: the output
        ends there). Under sampling too: a rejected draft is never resampled as itself."""
        kept, pos = 0, 0
        for drafts in self.rounds:
            n = 0
            while n < len(drafts) and pos + n < len(new) and new[pos + n] == drafts[n]:
                n += 1
            kept, pos = kept + n, pos + n + 1
        return kept

    def remove(self) -> None:
        self._hook.remove()
