"""``generate``'s decoding on in-memory ``transformers`` models: self-speculative greedy equals plain greedy token for
token, the acceptance count (exactly 1 when the late layers add nothing, below 1 when they change the prediction),
and its refusals (the early exit's range, classes that ignore it, prompts). The CLI on checkpoints and exports is in
``tests/integration/checkpoint/test_export.py``."""

from __future__ import annotations

import pytest
import torch

from eval.generate import check_early_exit, decode, encode_prompt, generate
from eval.generator import Generator
from eval.speculative import layers_run_at
from pretrain.config import ConfigError
from pretrain.export.hf import special_token_ids, to_hf_model
from tests.unit.export.test_hf import GPT2_CFG, LLAMA_CFG, one_thread, perturbed_state, tiny  # noqa: F401

LAYERS = 4
PROMPT = "The history of the city"


def make_generator(tokenizer, cfg, sd=None) -> Generator:
    model = to_hf_model(cfg, perturbed_state(cfg) if sd is None else sd, special_token_ids(tokenizer, cfg.kind))
    info = {"hf_class": type(model).__name__, "device": "cpu", "dtype": "float32"}
    return Generator(model, tokenizer, "test model", cfg.num_layers, cfg.max_seq_len, info)


@pytest.fixture
def llama(tokenizer):
    """Perturbed weights with the blocks' outputs and the final norm scaled up: near-initial weights predict the
    same tokens at every depth; these make the late layers change the prediction, so drafts get rejected."""
    cfg = tiny(LLAMA_CFG, num_layers=LAYERS, max_seq_len=48)
    sd = perturbed_state(cfg)
    for key in sd:
        if key.endswith(("o_proj.weight", "down_proj.weight")) or key == "final_norm.weight":
            sd[key] = sd[key] * 8
    return make_generator(tokenizer, cfg, sd)


def test_self_speculative_greedy_equals_plain_greedy(llama):
    for e in range(1, LAYERS):
        r = generate(llama, PROMPT, max_new_tokens=24, early_exit=e, draft_tokens=3, warmup=e == 1)
        spec = r["early_exit"]
        assert spec["identical"] and spec["continuation"] == r["continuation"], e
        assert spec["new_tokens"] == r["new_tokens"] > 0
        # every full-depth pass adds its accepted drafts plus one token of its own
        assert spec["accepted"] + spec["verify_passes"] == spec["new_tokens"]
        assert 0 <= spec["accepted"] <= spec["drafted"] and spec["drafted"] > 0
        assert spec["acceptance"] == spec["accepted"] / spec["drafted"]
        assert spec["drafted"] <= 3 * spec["verify_passes"]  # --draft-tokens bounds each draft
        assert spec["acceptance"] < 1  # the late layers change the prediction: some drafts are rejected


def test_acceptance_is_one_when_the_late_layers_add_nothing(tokenizer):
    """Zero output projections in the layers after the exit: the draft's logits are the full model's, bit for bit,
    so every drafted token is accepted (drafts never run past --max-new-tokens)."""
    cfg = tiny(LLAMA_CFG, num_layers=LAYERS, max_seq_len=48)
    sd = perturbed_state(cfg)
    for key in sd:
        if any(f"blocks.{i}." in key for i in range(2, LAYERS)) and key.endswith(
            ("attn.o_proj.weight", "ffn.down_proj.weight")
        ):
            sd[key] = torch.zeros_like(sd[key])
    gen = make_generator(tokenizer, cfg, sd)
    r = generate(gen, PROMPT, max_new_tokens=20, early_exit=2, draft_tokens=4, warmup=False)
    spec = r["early_exit"]
    assert spec["identical"]
    assert spec["accepted"] == spec["drafted"] > 0 and spec["acceptance"] == 1.0, spec
    assert spec["verify_passes"] < r["new_tokens"]  # several tokens per full-depth pass
    # No early end of a draft on low confidence: every draft is 4 tokens long (the last one shorter), 5 tokens a pass.
    r = generate(gen, PROMPT, max_new_tokens=20, early_exit=2, draft_tokens=4, draft_confidence=0.0, warmup=False)
    spec = r["early_exit"]
    assert spec["identical"] and spec["acceptance"] == 1.0 and spec["draft_confidence"] == 0.0
    assert spec["verify_passes"] == -(-r["new_tokens"] // 5), spec
    # Decoding that ends on a drafted separator the full model accepts: that round adds no token of its own, and
    # every new token is a drafted one that was accepted.
    first = decode(gen, encode_prompt(gen, PROMPT), 1).ids[0]
    gen.model.generation_config.eos_token_id = first  # the first drafted token ends the decoding
    r = generate(gen, PROMPT, max_new_tokens=20, early_exit=2, draft_tokens=4, draft_confidence=0.0, warmup=False)
    spec = r["early_exit"]
    assert spec["identical"] and r["new_tokens"] == 1 and spec["verify_passes"] == 1, spec
    assert spec["accepted"] == 1 and spec["acceptance"] == 1 / spec["drafted"], spec


def test_refusals(llama, tokenizer):
    for e in (0, LAYERS, LAYERS + 3):
        with pytest.raises(ConfigError, match=f"--early-exit {e}: must be at least 1 and below the model's depth"):
            check_early_exit(llama, e)
    assert layers_run_at(llama.model, LAYERS, 2) == 2
    # GPT-2 runs all its blocks whatever config.num_hidden_layers says: drafting would be the full model.
    gpt2 = make_generator(tokenizer, tiny(GPT2_CFG, tie_embeddings=True, num_layers=3))
    assert type(gpt2.model).__name__ == "GPT2LMHeadModel"
    with pytest.raises(ConfigError, match="GPT2LMHeadModel ignores config.num_hidden_layers"):
        check_early_exit(gpt2, 1)
    remote = make_generator(tokenizer, tiny(GPT2_CFG, bias=True, num_layers=3))  # the trust_remote_code class
    assert type(remote.model).__name__ == "PretrainTransformerForCausalLM"
    with pytest.raises(ConfigError, match="without a KV cache"):
        check_early_exit(remote, 1)
    plain = generate(remote, PROMPT, max_new_tokens=4)  # without --early-exit it generates (no separate body)
    assert plain["new_tokens"] == 4 and remote.model.config.num_hidden_layers == 3
    with pytest.raises(ConfigError, match="context is 48 tokens"):
        encode_prompt(llama, "word " * 200)
    with pytest.raises(ConfigError, match="empty"):
        encode_prompt(llama, "")
    with pytest.raises(ConfigError, match="--max-new-tokens"):
        generate(llama, PROMPT, max_new_tokens=0)
    with pytest.raises(ConfigError, match="^generate --draft-tokens/--draft-confidence need --early-exit E$"):
        generate(llama, PROMPT, draft_tokens=3)  # nothing would draft: refused, not ignored
    llama.model.generation_config.cache_implementation = "static"  # transformers drafts with a dynamic cache only
    with pytest.raises(ConfigError, match="asks for a 'static' KV cache.*remove cache_implementation"):
        check_early_exit(llama, 2)


def test_no_draft_has_no_acceptance_rate_and_a_difference_names_its_margin(llama, capsys):
    from eval.generate import first_difference, print_result

    r = generate(llama, PROMPT, max_new_tokens=1, early_exit=2, warmup=False)
    e = r["early_exit"]
    assert e["drafted"] == 0 and e["acceptance"] is None and e["first_difference"] is None, e
    print_result(r)
    assert "acceptance rate: n/a (0 of 0 drafted tokens accepted, 1 verification passes)" in capsys.readouterr().out
    # Two decodings that part: where, and how far apart the full model's top two logits are there.
    ids = encode_prompt(llama, PROMPT)
    plain = decode(llama, ids, 6).ids
    other = plain[:3] + [(plain[3] + 1) % 50]
    d = first_difference(llama, ids, plain, other)
    top = llama.model(input_ids=torch.tensor([ids + plain[:3]])).logits[0, -1].topk(2).values
    assert d == {"token": 3, "top2_margin": pytest.approx(float(top[0] - top[1]))} and d["top2_margin"] >= 0
    assert first_difference(llama, ids, plain, plain[:4]) is None
    r["early_exit"].update(identical=False, first_difference=d)
    print_result(r)
    said = capsys.readouterr().out
    assert "DIFFERS from plain greedy from new token 3 (the full model's top two logits there: " in said


def test_sampling_is_seeded_and_counted(llama):
    """--temperature samples (speculative sampling with --early-exit): the same seed gives the same tokens, another
    seed other tokens; the counts hold as under greedy decoding."""
    kw = dict(max_new_tokens=16, early_exit=2, draft_tokens=3, temperature=1.0, warmup=False)
    a, b, c = (generate(llama, PROMPT, seed=s, **kw) for s in (1, 1, 2))
    assert not a["greedy"] and a["continuation"] == b["continuation"] != c["continuation"]
    assert a["early_exit"]["continuation"] == b["early_exit"]["continuation"]
    for r in (a, c):
        e = r["early_exit"]
        assert e["accepted"] + e["verify_passes"] == e["new_tokens"] and 0 <= e["accepted"] <= e["drafted"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--temperature", "1", "--top-k", "-1"], "generate --top-k: must be >= 0 (0: all tokens), got -1"),
        (["--temperature", "1", "--top-p", "0"], "generate --top-p: must be in (0, 1], got 0.0"),
        (["--temperature", "1", "--top-p", "2"], "generate --top-p: must be in (0, 1], got 2.0"),
        (["--top-k", "5"], "generate: --top-k and --top-p apply to sampling; add --temperature T (> 0)"),
        (["--draft-tokens", "3"], "generate --draft-tokens/--draft-confidence need --early-exit E"),
        (["--draft-confidence", "0.5"], "generate --draft-tokens/--draft-confidence need --early-exit E"),
        (["--early-exit", "1", "--draft-tokens", "0"], "generate --draft-tokens: must be at least 1, got 0"),
        (["--temperature", "nan"], "generate --temperature: must be a finite number >= 0, got nan"),
        (["--temperature", "inf"], "generate --temperature: must be a finite number >= 0, got inf"),
        (["--seed", str(2**64)], f"generate --seed: must be in [-2**63, 2**64), got {2**64}"),
        (["--max-new-tokens", "0"], "generate --max-new-tokens: must be at least 1, got 0"),
    ],
)
def test_sampling_options_are_checked_before_the_model_loads(args, message):
    from eval.generate import main

    with pytest.raises(ConfigError) as e:
        main(["/no/such/model", "--prompt", "x", *args])
    assert str(e.value) == message


def test_a_device_this_machine_lacks_is_refused_before_loading(monkeypatch):
    from eval.generate import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError) as e:
        main(["/no/such/model", "--prompt", "x", "--device", "cuda:3"])
    assert str(e.value) == "generate --device cuda:3: this machine has 2 CUDA device(s), cuda:0 to cuda:1"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="^generate --device cuda:0: no CUDA device is available here$"):
        main(["/no/such/model", "--prompt", "x", "--device", "cuda:0"])
    with pytest.raises(ConfigError, match="^/no/such/model: no such checkpoint"):  # cpu: as before
        main(["/no/such/model", "--prompt", "x", "--device", "cpu"])


def test_the_continuation_keeps_the_space_a_sentencepiece_decoder_strips():
    """A decoder that strips the first token's leading space (SentencePiece's "▁"): the new tokens decoded alone
    would glue the first new word to the prompt; decoded after the prompt they keep the space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from eval.generate import continuation

    t = Tokenizer(models.WordLevel({"<unk>": 0, "▁Hello": 1, "▁world": 2, "▁again": 3}, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    t.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    tok = PreTrainedTokenizerFast(tokenizer_object=t)
    assert tok.decode([2, 3]) == "world again"  # what decoding the new tokens alone gives
    assert continuation(tok, [1], [2, 3]) == " world again"


def test_an_error_while_drafting_leaves_the_model_whole(llama, monkeypatch):
    """transformers truncates the model's depth while it drafts and does not put it back when a draft raises (an
    interrupt, out of memory): ``decode`` does, so the next plain decoding runs every layer."""
    import eval.speculative

    def interrupted(self, module, args, kwargs):
        if self.base.config.num_hidden_layers < self.num_layers:
            raise KeyboardInterrupt

    monkeypatch.setattr(eval.speculative.DraftCounter, "_count", interrupted)
    with pytest.raises(KeyboardInterrupt):
        generate(llama, PROMPT, max_new_tokens=8, early_exit=2, warmup=False)
    assert llama.model.model.config.num_hidden_layers == LAYERS
