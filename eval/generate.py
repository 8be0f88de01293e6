"""Sampling from a run, a checkpoint or a Hugging Face directory, with self-speculative (early-exit) decoding.

    ./launch.sh generate RUN_ID|CHECKPOINT|HF_DIR --prompt TEXT [--max-new-tokens N] [--early-exit E]
                         [--draft-tokens N] [--draft-confidence P] [--temperature T] [--top-k K] [--top-p P]
                         [--seed S] [--step N] [--device D] [--dtype DT] [--json]

The model is the ``transformers`` model the export would write (:func:`pretrain.export.hf.to_hf_model`, built in
memory from the checkpoint's consolidated weights; nothing is written) or the one an export directory holds, with
the run's tokenizer. The prompt is encoded without added special tokens (training sees documents after the
``<|endoftext|>`` separator: write it into the prompt to start a fresh document); generation stops at the
separator or after ``--max-new-tokens`` (capped by the model's context).

Decoding is ``transformers``' ``generate``: greedy by default, sampling with ``--temperature`` > 0. With
``--early-exit E`` the same prompt is decoded twice, plainly and self-speculatively
(``generate(..., assistant_early_exit=E)``: the first E layers and the shared final norm and LM head draft up to
``--draft-tokens`` tokens, a draft ending early at a token whose probability is below ``--draft-confidence``; the
full model verifies them in one forward pass and keeps the longest agreeing prefix plus its own next token). Under
greedy decoding both outputs must be identical token for token, up to rounding: a several-token pass computes the
same logits with other shapes than a one-token pass (a difference of order 1e-7 in float32, far more in bfloat16 or
float16), so where the full model's top two tokens are that close the two decodings may part. The result says
whether they are identical and, where they are not, at which new token they part and how far apart the full model's
top two logits are there (``first_difference``): a near-tie, or a defect.

Acceptance rate = drafted tokens accepted / drafted tokens. Drafted tokens are counted as the model's forward passes
at depth E (each drafts one token); every full-depth forward pass verifies one draft (its last input tokens) and adds
the longest prefix of it that agrees plus one token of its own (none when the draft's accepted tokens end at the
separator), so accepted = the drafts' tokens found in the output, new tokens - full-depth passes (+1 when decoding
ended on an accepted drafted separator). A drafted token beyond the end (the separator or ``--max-new-tokens``)
counts as drafted and not accepted (no draft: no acceptance rate). tokens/s = new tokens / wall seconds of the
``generate`` call (after an untimed warm-up call of each decoding), on the device and dtype asked for.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from eval.generator import DTYPES, Generator, load_generator
from eval.speculative import DraftCounter, base_model, check_exit
from pretrain.config import ConfigError
from pretrain.config.errors import ArgumentParser

DRAFT_SETTINGS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
"""The fields of the model's generation config that ``transformers`` drafts by (set for one call, then restored)."""


def check_early_exit(gen: Generator, early_exit: int) -> None:
    """ConfigError unless 1 <= ``early_exit`` < the model's depth and the model's class drafts at that depth."""
    check_exit(gen.model, gen.num_layers, early_exit)


def check_draft(early_exit: int | None, draft_tokens: int | None, draft_confidence: float | None) -> None:
    """ConfigError for a draft setting out of range, or given without ``early_exit`` (nothing drafts then)."""
    if draft_tokens is not None and draft_tokens < 1:
        raise ConfigError(f"generate --draft-tokens: must be at least 1, got {draft_tokens}")
    if draft_confidence is not None and not 0 <= draft_confidence <= 1:
        raise ConfigError(f"generate --draft-confidence: must be in [0, 1], got {draft_confidence}")
    if early_exit is None and (draft_tokens is not None or draft_confidence is not None):
        raise ConfigError("generate --draft-tokens/--draft-confidence need --early-exit E")


# ----------------------------------------------------------------------------------------------
# Decoding
# ----------------------------------------------------------------------------------------------


@dataclass
class Decoded:
    ids: list[int]
    """The new token ids (prompt excluded)."""
    seconds: float
    drafted: int | None = None
    accepted: int | None = None
    verify_passes: int | None = None

    @property
    def tokens_per_s(self) -> float:
        return len(self.ids) / self.seconds if self.seconds > 0 else float("inf")

    @property
    def acceptance(self) -> float | None:
        if self.drafted is None or self.accepted is None:
            return None
        return self.accepted / self.drafted if self.drafted else None


def encode_prompt(gen: Generator, prompt: str) -> list[int]:
    """The prompt's ids (no special tokens added); ConfigError when empty or leaving no room in the context."""
    ids = list(gen.tokenizer(prompt, add_special_tokens=False)["input_ids"])
    if not ids:
        raise ConfigError("generate --prompt: the prompt is empty (it encodes to no tokens)")
    if len(ids) >= gen.context:
        raise ConfigError(
            f"generate --prompt: the prompt is {len(ids)} tokens; the model's context is {gen.context} tokens "
            f"(a prompt of at most {gen.context - 1} leaves room for a new token)"
        )
    return ids


@torch.no_grad()
def decode(
    gen: Generator,
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    early_exit: int | None = None,
    draft_tokens: int | None = None,
    draft_confidence: float | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
) -> Decoded:
    """One timed ``generate`` call from ``prompt_ids`` (plain, or self-speculative at ``early_exit``: drafts of at most
    ``draft_tokens``, each stopped early where the draft's top probability is below ``draft_confidence``; None:
    ``transformers``' defaults)."""
    model = gen.model
    ids = torch.tensor([prompt_ids], device=model.device)
    tok = gen.tokenizer
    kwargs: dict[str, Any] = dict(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
        do_sample=temperature > 0,
    )
    if temperature > 0:
        kwargs.update(temperature=temperature, top_k=top_k or 0, top_p=1.0 if top_p is None else top_p)
    counter = None
    # The drafting model is the model itself: transformers reads how it drafts from the model's generation config.
    config = model.generation_config
    saved = {k: getattr(config, k) for k in DRAFT_SETTINGS}
    depth = base_model(model).config.num_hidden_layers  # drafting truncates it, and an error in a draft leaves it so
    if early_exit is not None:
        kwargs["assistant_early_exit"] = early_exit
        if draft_tokens is not None:
            config.num_assistant_tokens, config.num_assistant_tokens_schedule = draft_tokens, "constant"
        if draft_confidence is not None:
            config.assistant_confidence_threshold = draft_confidence
        counter = DraftCounter(model, gen.num_layers)
    torch.manual_seed(seed)
    try:
        t0 = time.perf_counter()
        out = model.generate(**kwargs)
        if model.device.type == "cuda":
            torch.cuda.synchronize(model.device)
        seconds = time.perf_counter() - t0
    finally:
        for k, v in saved.items():
            setattr(config, k, v)
        base_model(model).config.num_hidden_layers = depth
        if counter is not None:
            counter.remove()
    new = out[0, len(prompt_ids) :].tolist()
    if counter is None:
        return Decoded(new, seconds)
    accepted = counter.accepted(new)
    own = len(new) - counter.verified  # one token of its own from every verification, but after a drafted separator
    if not (0 <= accepted <= counter.drafted and own <= accepted <= own + 1):  # the rule no longer describes the loop
        raise RuntimeError(
            f"self-speculative counting: {len(new)} new tokens from {counter.verified} verification and "
            f"{counter.drafted} draft passes is inconsistent"
        )
    return Decoded(new, seconds, drafted=counter.drafted, accepted=accepted, verify_passes=counter.verified)


@torch.no_grad()
def first_difference(gen: Generator, prompt_ids: list[int], a: list[int], b: list[int]) -> dict[str, Any] | None:
    """Where two decodings of ``prompt_ids`` part: the index of the first new token that differs and the gap between
    the full model's two largest logits there (one forward pass over the prompt and the common prefix, no cache);
    None when one is a prefix of the other."""
    at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if at is None:
        return None
    ids = torch.tensor([prompt_ids + a[:at]], device=gen.model.device)
    top = gen.model(input_ids=ids, use_cache=False).logits[0, -1].float().topk(2).values
    return {"token": at, "top2_margin": float(top[0] - top[1])}


def continuation(tok, prompt_ids: list[int], new: list[int]) -> str:
    """The text ``new`` adds to the prompt's: decoded together with the prompt, so that a tokenizer whose decoder
    strips the first token's leading space (SentencePiece's) keeps the space between them."""
    before = tok.decode(prompt_ids)
    text = tok.decode(prompt_ids + new)
    return text[len(before) :] if text.startswith(before) else tok.decode(new)


def generate(
    gen: Generator,
    prompt: str,
    *,
    max_new_tokens: int = 64,
    early_exit: int | None = None,
    warmup: bool = True,
    **sampling: Any,
) -> dict[str, Any]:
    """Decode ``prompt`` plainly and, with ``early_exit``, self-speculatively; the result as a JSON-able dict."""
    if max_new_tokens < 1:
        raise ConfigError(f"generate --max-new-tokens: must be at least 1, got {max_new_tokens}")
    if early_exit is not None:
        check_early_exit(gen, early_exit)
    check_draft(early_exit, sampling.get("draft_tokens"), sampling.get("draft_confidence"))
    draft = {k: sampling.pop(k, None) for k in ("draft_tokens", "draft_confidence")}
    prompt_ids = encode_prompt(gen, prompt)
    n = min(max_new_tokens, gen.context - len(prompt_ids))
    if warmup:
        decode(gen, prompt_ids, min(n, 2), **sampling)
        if early_exit is not None:
            decode(gen, prompt_ids, min(n, 2), early_exit=early_exit, **draft, **sampling)
    plain = decode(gen, prompt_ids, n, **sampling)
    tok = gen.tokenizer
    greedy = sampling.get("temperature", 0.0) <= 0
    result: dict[str, Any] = {
        "source": gen.label,
        **gen.info,
        "layers": gen.num_layers,
        "context": gen.context,
        "prompt": prompt,
        "prompt_tokens": len(prompt_ids),
        "max_new_tokens": n,
        "greedy": greedy,
        "continuation": continuation(tok, prompt_ids, plain.ids),
        "new_tokens": len(plain.ids),
        "seconds": plain.seconds,
        "tokens_per_s": plain.tokens_per_s,
    }
    if n < max_new_tokens:
        result["capped_by_context"] = True
    if early_exit is not None:
        spec = decode(gen, prompt_ids, n, early_exit=early_exit, **draft, **sampling)
        result["early_exit"] = {
            "layers": early_exit,
            **draft,
            "continuation": continuation(tok, prompt_ids, spec.ids),
            "new_tokens": len(spec.ids),
            "seconds": spec.seconds,
            "tokens_per_s": spec.tokens_per_s,
            "speedup": spec.tokens_per_s / plain.tokens_per_s if plain.tokens_per_s > 0 else None,
            "identical": spec.ids == plain.ids if greedy else None,  # sampled decodings need not agree
            "first_difference": first_difference(gen, prompt_ids, plain.ids, spec.ids) if greedy else None,
            "drafted": spec.drafted,
            "accepted": spec.accepted,
            "acceptance": spec.acceptance,
            "verify_passes": spec.verify_passes,
        }
    return result


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------


def print_result(r: dict[str, Any]) -> None:
    mode = "greedy" if r["greedy"] else "sampled"
    print(f"generate: {r['source']} ({r['hf_class']}, {r['layers']} layers, {r['device']} {r['dtype']})")
    print(f"  prompt: {r['prompt']!r} ({r['prompt_tokens']} tokens)")
    print(f"  text:   {r['prompt'] + r['continuation']!r}")
    capped = f" (--max-new-tokens capped at {r['max_new_tokens']} by the context)" if r.get("capped_by_context") else ""
    print(f"  {mode}: {r['new_tokens']} new tokens in {r['seconds']:.3f} s, {r['tokens_per_s']:.1f} tokens/s{capped}")
    e = r.get("early_exit")
    if e:
        same = ""
        if r["greedy"]:
            same = "identical to plain greedy" if e["identical"] else "DIFFERS from plain greedy"
            if d := e.get("first_difference"):
                margin = f"{d['top2_margin']:.2g}"
                same += f" from new token {d['token']} (the full model's top two logits there: {margin} apart)"
        print(
            f"  self-speculative (draft with {e['layers']} of {r['layers']} layers): {e['new_tokens']} new tokens in "
            f"{e['seconds']:.3f} s, {e['tokens_per_s']:.1f} tokens/s ({e['speedup']:.2f}x)"
            + (f", {same}" if same else "")
        )
        if not (r["greedy"] and e["identical"]):
            print(f"  self-speculative text: {r['prompt'] + e['continuation']!r}")
        rate = "n/a" if e["acceptance"] is None else f"{e['acceptance']:.3f}"
        print(
            f"  acceptance rate: {rate} ({e['accepted']} of {e['drafted']} drafted tokens accepted, "
            f"{e['verify_passes']} verification passes)"
        )


def main(argv: list[str]) -> int:
    p = ArgumentParser(
        prog="launch.sh generate",
        description="Generate text from a run, a checkpoint or a Hugging Face directory; with --early-exit E also "
        "self-speculatively (the first E layers draft, the full model verifies) with its acceptance rate.",
    )
    p.add_argument("source", help="MLflow run id, run dir (latest checkpoint), checkpoint dir, or Hugging Face dir")
    p.add_argument("--prompt", required=True, help="the text to continue (encoded without added special tokens)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="at most this many new tokens (default 64)")
    p.add_argument(
        "--early-exit",
        type=int,
        default=None,
        metavar="E",
        help="also decode self-speculatively, drafting with the first E layers (1 <= E < depth)",
    )
    p.add_argument(
        "--draft-tokens",
        type=int,
        default=None,
        metavar="N",
        help="draft at most N tokens per verification (default: transformers' num_assistant_tokens, 20)",
    )
    p.add_argument(
        "--draft-confidence",
        type=float,
        default=None,
        metavar="P",
        help="stop a draft early at a drafted token whose probability is below P; 0: never "
        "(default: transformers' assistant_confidence_threshold, 0.4)",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="> 0 samples (default 0: greedy)")
    p.add_argument("--top-k", type=int, default=None, help="sampling: keep the K most likely tokens")
    p.add_argument("--top-p", type=float, default=None, help="sampling: nucleus probability mass")
    p.add_argument("--greedy", action="store_true", help="greedy decoding (the default; refuses --temperature)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step of a run (default: latest)")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="weights dtype (default float32)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    a = p.parse_args(argv)
    if a.greedy and a.temperature > 0:
        raise ConfigError("generate: --greedy and --temperature > 0 contradict each other")
    if not (math.isfinite(a.temperature) and a.temperature >= 0):
        raise ConfigError(f"generate --temperature: must be a finite number >= 0, got {a.temperature}")
    if not -(2**63) <= a.seed < 2**64:
        raise ConfigError(f"generate --seed: must be in [-2**63, 2**64), got {a.seed}")
    if a.max_new_tokens < 1:
        raise ConfigError(f"generate --max-new-tokens: must be at least 1, got {a.max_new_tokens}")
    if a.top_k is not None and a.top_k < 0:
        raise ConfigError(f"generate --top-k: must be >= 0 (0: all tokens), got {a.top_k}")
    if a.top_p is not None and not 0 < a.top_p <= 1:
        raise ConfigError(f"generate --top-p: must be in (0, 1], got {a.top_p}")
    if a.temperature == 0 and (a.top_k is not None or a.top_p is not None):
        raise ConfigError("generate: --top-k and --top-p apply to sampling; add --temperature T (> 0)")
    check_draft(a.early_exit, a.draft_tokens, a.draft_confidence)
    gen = load_generator(a.source, a.step, a.device, a.dtype)
    result = generate(
        gen,
        a.prompt,
        max_new_tokens=a.max_new_tokens,
        early_exit=a.early_exit,
        draft_tokens=a.draft_tokens,
        draft_confidence=a.draft_confidence,
        temperature=a.temperature,
        top_k=a.top_k,
        top_p=a.top_p,
        seed=a.seed,
    )
    if a.json:
        print(json.dumps(result, sort_keys=True, default=str))
    else:
        print_result(result)
    return 0
