"""Evaluation: the metric core by hand, bytes per token, checkpoint vs exported directory agreement. The command
(JSON and table output, MLflow logging, the optional harness) is in ``tests/integration/checkpoint/test_eval.py``."""

from __future__ import annotations

import importlib.util
import json
import math
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from eval.evaluate import (
    evaluate,
    evaluate_source,
    evaluate_tasks,
    print_table,
    run_harness,
    score,
    token_byte_lengths,
)
from eval.generator import load_generator
from eval.sources import open_source
from pretrain.config import ConfigError
from pretrain.export.hf import export_checkpoint
from tests.conftest import corpus_lines
from tests.unit.export.test_hf import (  # noqa: F401 - the autouse fixture is used by name
    V,
    one_thread,
    perturbed_state,
    small_run_config,
    write_checkpoint,
)

# ----------------------------------------------------------------------------------------------
# The metric core
# ----------------------------------------------------------------------------------------------


def test_score_decoder_by_hand():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 7, generator=g)
    ids = torch.randint(0, 7, (2, 5), generator=g)
    labels = ids.clone()
    labels[1, 3] = -100
    byte_lengths = torch.tensor([0, 1, 2, 3, 1, 1, 4])
    out = score(lambda x: logits, [{"input_ids": ids, "labels": labels}], "decoder", byte_lengths)
    target = labels[:, 1:]
    keep = target != -100
    nll = F.cross_entropy(logits[:, :-1][keep], target[keep], reduction="sum").item()
    assert out["tokens"] == 7 and out["bytes"] == int(byte_lengths[target[keep]].sum())
    assert out["loss"] == pytest.approx(nll / 7, rel=1e-6)
    assert out["ppl"] == pytest.approx(math.exp(nll / 7), rel=1e-6)
    assert out["bits_per_byte"] == pytest.approx(nll / (math.log(2) * out["bytes"]), rel=1e-6)
    assert "mlm_acc" not in out


def test_score_encoder_by_hand():
    logits = torch.full((1, 4, 5), -10.0)
    logits[0, 0, 2] = logits[0, 1, 3] = logits[0, 2, 0] = 10.0
    labels = torch.tensor([[2, 1, -100, -100]])
    out = score(lambda x: logits, [{"input_ids": labels.clamp(min=0), "labels": labels}], "encoder")
    assert out["tokens"] == 2 and out["mlm_acc"] == 0.5 and "bits_per_byte" not in out
    with pytest.raises(ValueError, match="no predicted tokens"):
        score(lambda x: logits, [{"input_ids": labels, "labels": torch.full_like(labels, -100)}], "encoder")


def test_token_bytes_spell_the_text(tokenizer):
    """For byte-level BPE, the bytes of the tokens of a text are exactly its UTF-8 bytes."""
    lengths = token_byte_lengths(tokenizer, V)
    texts = corpus_lines(300) + ["naïve café 日本語 🙂", "  spaces\tand\nnewlines "]
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert int(lengths[ids].sum()) == len(text.encode("utf-8")), text
    assert lengths[tokenizer.eos_token_id] == 0 and lengths[len(tokenizer) :].sum() == 0


def test_token_bytes_of_a_sentencepiece_style_vocabulary_with_byte_fallback():
    """Llama 2's tokenizer style (``▁`` for a space, ``<0xNN>`` for a byte it lacks): the tokens of a text spell its
    UTF-8 bytes plus the one space the tokenizer puts before its first word."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tok.train_from_iterator(
        ["the cat sat on the mat", "hello world"] * 50, trainers.BpeTrainer(vocab_size=400, special_tokens=specials)
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    lengths = token_byte_lengths(fast, len(fast))
    for text in ("the cat sat", "naïve café 日本語 🙂", "x"):
        ids = fast(text, add_special_tokens=False)["input_ids"]
        assert any(fast.convert_ids_to_tokens(i).startswith("<0x") for i in ids) or text == "the cat sat"
        assert int(lengths[ids].sum()) == len(text.encode("utf-8")) + 1, (text, fast.convert_ids_to_tokens(ids))


# ----------------------------------------------------------------------------------------------
# Checkpoint vs exported directory
# ----------------------------------------------------------------------------------------------

AGREE = {
    "llama-decoder": ["model.norm=rmsnorm", "model.activation=swiglu", "model.num_kv_heads=2"],
    "remote-code-decoder": ["model.norm_placement=sandwich", "model.tie_embeddings=false"],
    "bert-encoder": [
        "model.kind=encoder",
        "model.norm_placement=post",
        "model.position=learned",
        "model.embedding_norm=true",
        "model.mlm_head_transform=true",
        "model.bias=true",
    ],
}


@pytest.mark.parametrize("name", list(AGREE))
def test_checkpoint_and_export_agree(name, tokenizer_dir, workdir):
    cfg = small_run_config(workdir, tokenizer_dir, AGREE[name])
    ckpt = write_checkpoint(workdir / "run", cfg, perturbed_state(cfg.model, seed=1), tokenizer_dir, 4)
    export_checkpoint(str(ckpt), workdir / "hf", log=lambda *a: None)
    a = evaluate(str(ckpt))
    b = evaluate(str(workdir / "hf"))
    print(f"\n{name}: checkpoint loss {a['loss']:.6f}, export loss {b['loss']:.6f}")
    assert a["tokens"] == b["tokens"] > 0 and a["sequences"] == b["sequences"] == 16
    for key in ("loss", "ppl", "bits_per_byte", "mlm_acc"):
        assert (
            (key in a)
            == (key in b)
            == (
                key in (("loss", "ppl", "mlm_acc") if cfg.model.kind == "encoder" else ("loss", "ppl", "bits_per_byte"))
            )
        )
        if key in a:
            assert abs(a[key] - b[key]) <= 1e-4 * max(1.0, abs(a[key])), key
    if cfg.model.kind == "decoder":
        assert a["bytes"] == b["bytes"] > a["tokens"]  # BPE tokens average more than a byte
        assert a["sample"] == b["sample"]  # greedy, same weights: same text
    # Other data than the run's validation set.
    other = workdir / "other.txt"
    other.write_text("\n".join(corpus_lines(400)[:200]) + "\n", encoding="utf-8")
    c = evaluate(str(ckpt), data=[str(other)], sample=False)
    assert c["data"] == [str(other)] and c["loss"] != a["loss"]


def test_a_model_without_a_hf_class_is_scored_without_a_sample(tokenizer_dir, workdir, capsys):
    """model.qk_norm has no Hugging Face class: the loss is scored and printed, the greedy sample and the harness
    are skipped with a note."""
    cfg = small_run_config(workdir, tokenizer_dir, [*AGREE["llama-decoder"], "model.qk_norm=true"])
    ckpt = write_checkpoint(workdir / "run", cfg, perturbed_state(cfg.model, seed=1), tokenizer_dir, 4)
    src = open_source(str(ckpt))
    r = evaluate_source(src, sequences=2)
    assert r["loss"] > 0 and "sample" not in r
    assert r["sample_skipped"] == "model.qk_norm has no Hugging Face class, which transformers' generate needs"
    print_table(r)
    out = capsys.readouterr().out
    assert "loss" in out and "greedy sample  skipped: model.qk_norm has no Hugging Face class" in out
    assert run_harness(src, "t") == ("harness: model.qk_norm has no Hugging Face class; skipped tasks t", None)


def test_tasks_on_other_data_are_logged_beside_the_runs_own(tokenizer_dir, workdir, monkeypatch):
    """eval --data X --tasks T logs eval/X/T/acc (as the loss goes to eval/X/loss), never over eval/T/acc."""
    import dataclasses

    from pretrain.train import tracking

    logged: list[tuple[dict, int]] = []

    class Tracker:
        def __init__(self, uri, run_id):
            pass

        def log_metrics(self, metrics, step):
            logged.append((metrics, step))

    monkeypatch.setattr(tracking, "Tracker", Tracker)
    cfg = small_run_config(workdir, tokenizer_dir, AGREE["llama-decoder"])
    ckpt = write_checkpoint(workdir / "run", cfg, perturbed_state(cfg.model, seed=1), tokenizer_dir, 4)
    src = dataclasses.replace(open_source(str(ckpt)), run_id="r")
    task = workdir / "t.jsonl"
    task.write_text(json.dumps({"context": "The capital of France is", "choices": [" Paris", " Rome"], "answer": 0}))
    other = workdir / "other.txt"
    other.write_text("\n".join(corpus_lines(200)) + "\n", encoding="utf-8")
    metrics = evaluate_tasks(src, [str(task)])
    assert set(metrics) == {"eval/t/acc", "eval/t/acc_norm"} and logged[-1] == (metrics, 4)
    evaluate_tasks(src, [str(task)], data=[str(other)])
    assert logged[-1] == ({f"eval/other/{k[len('eval/') :]}": v for k, v in metrics.items()}, 4)


def _hf_encoder(family: str, tokenizer, out: Path, **config) -> Path:
    """A one-layer ``{family}ForMaskedLM`` of the test vocabulary saved with ``tokenizer`` in ``out`` (and a data
    file beside it, returned)."""
    import transformers

    cfg = getattr(transformers, f"{family}Config")(
        vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64, **config
    )
    getattr(transformers, f"{family}ForMaskedLM")(cfg).save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    data = out.parent / "d.txt"
    data.write_text("\n".join(corpus_lines(300)) + "\n", encoding="utf-8")
    return data


def test_plain_hf_dir_needs_data(tokenizer, tmp_path):
    data = _hf_encoder("Bert", tokenizer, tmp_path / "bert", max_position_embeddings=32)
    with pytest.raises(ConfigError, match="--data"):
        evaluate(str(tmp_path / "bert"))
    out = evaluate(str(tmp_path / "bert"), data=[str(data)], sequences=4)
    assert out["kind"] == "encoder" and 0.0 <= out["mlm_acc"] <= 1.0 and out["seq_len"] == 32


def test_a_roberta_style_dir_is_scored_at_the_positions_it_can_hold(tokenizer, tmp_path):
    """RoBERTa's position ids start after its padding id: of max_position_embeddings = 32 + pad + 1, 32 hold tokens,
    and the default length is those 32 (the whole table would index past it)."""
    pad = tokenizer.pad_token_id
    data = _hf_encoder(
        "Roberta", tokenizer, tmp_path / "roberta", max_position_embeddings=32 + pad + 1, pad_token_id=pad
    )
    out = evaluate(str(tmp_path / "roberta"), data=[str(data)], sequences=4)
    assert out["kind"] == "encoder" and out["seq_len"] == 32 and math.isfinite(out["loss"])
    with pytest.raises(ConfigError, match="context, 32; got 33"):
        evaluate(str(tmp_path / "roberta"), data=[str(data)], sequences=4, seq_len=33)


# ----------------------------------------------------------------------------------------------
# Refusals and what is left behind
# ----------------------------------------------------------------------------------------------


def test_bad_arguments_and_a_damaged_export_are_one_line(tokenizer_dir, workdir):
    cfg = small_run_config(workdir, tokenizer_dir, AGREE["llama-decoder"])
    ckpt = write_checkpoint(workdir / "run", cfg, perturbed_state(cfg.model, seed=1), tokenizer_dir, 4)
    T = cfg.model.max_seq_len
    for kwargs, message in [
        ({"seq_len": T + 1}, f"--seq-len must be from 2 to the model's context, {T}; got {T + 1}"),
        ({"seq_len": 1}, f"--seq-len must be from 2 to the model's context, {T}; got 1"),
        ({"sequences": 0}, "--sequences must be > 0, got 0"),
    ]:
        with pytest.raises(ConfigError) as e:
            evaluate(str(ckpt), sample=False, **kwargs)
        assert str(e.value) == message
    assert evaluate(str(ckpt), sample=False, seq_len=T // 2, sequences=3)["sequences"] == 3

    fifo = workdir / "t.jsonl"
    os.mkfifo(fifo)  # named, never opened (reading it would block)
    for spec, message in [
        (str(workdir / "gone.jsonl"), "is neither heldout_lastword nor an existing .jsonl task file"),
        (str(fifo), "is a FIFO, not a regular file"),
    ]:
        with pytest.raises(ConfigError, match=rf"^eval.tasks\[0\]: .*{message}$"):
            evaluate_tasks(open_source(str(ckpt), None), [spec], track=False)

    export_checkpoint(str(ckpt), workdir / "hf", log=lambda *a: None)
    original = (workdir / "hf" / "config.json").read_text()
    config = json.loads(original)
    (workdir / "hf" / "config.json").write_text(json.dumps({**config, "foo": 1}, indent=1))  # edited, still loads
    assert evaluate(str(workdir / "hf"), sample=False)["loss"] > 0
    (workdir / "hf" / "config.json").write_text(json.dumps({**config, "architectures": []}))
    with pytest.raises(ConfigError) as e:
        evaluate(str(workdir / "hf"), sample=False)
    assert str(e.value).startswith(f"eval: {workdir / 'hf'}: config.json has ") and "the export's manifest says" in str(
        e.value
    )
    (workdir / "hf" / "config.json").write_text(original)
    weights = workdir / "hf" / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(1000)
    for who, open_it in [("eval", lambda p: evaluate(p, sample=False)), ("generate", load_generator)]:
        with pytest.raises(ConfigError) as e:
            open_it(str(workdir / "hf"))
        assert str(e.value).startswith(
            f"{who}: {workdir / 'hf'}: model.safetensors has 1,000 bytes, the export's manifest says {size:,}; "
            "export it again (./launch.sh export RUN_ID --out DIR). Loading said: SafetensorError: "
        )
    (workdir / "hf" / "pretrain_export_manifest.json").unlink()  # not ours any more: the loader's own words
    with pytest.raises(ConfigError, match=rf"^eval: {workdir / 'hf'}: .*\(SafetensorError\)$"):
        evaluate(str(workdir / "hf"), sample=False)


def test_the_harness_reads_a_temporary_export_that_is_removed_after(tokenizer_dir, workdir, monkeypatch):
    import sys
    import tempfile
    import types

    cfg = small_run_config(workdir, tokenizer_dir, AGREE["llama-decoder"])
    ckpt = write_checkpoint(workdir / "run", cfg, perturbed_state(cfg.model, seed=1), tokenizer_dir, 4)
    seen = []

    def simple_evaluate(model, model_args, tasks, device):  # lm_eval's entry point, as run_harness calls it
        path = Path(dict(kv.split("=", 1) for kv in model_args.split(","))["pretrained"])
        seen.append((path, (path / "model.safetensors").is_file()))
        return {"results": {tasks[0]: {"acc": 0.25}}}

    monkeypatch.setitem(sys.modules, "lm_eval", types.SimpleNamespace(simple_evaluate=simple_evaluate))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "lm_eval" else real(name, *a))
    scratch = workdir / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    line, results = run_harness(open_source(str(ckpt)), "t")
    assert line == "harness: t: acc 0.2500" and results == {"t": {"acc": 0.25}}
    assert seen and seen[0][1] and str(seen[0][0]).startswith(str(scratch))
    assert list(scratch.glob("pretrain-eval-*")) == [], "the temporary export is removed"  # (torch's caches may stay)


@pytest.mark.parametrize("name", ["a,b", "a=b"])
def test_the_harness_refuses_a_path_model_args_cannot_carry(name, tmp_path, monkeypatch):
    """lm_eval's model_args is 'key=value,...': a ',' in the path would cut it (loading another directory)."""
    import contextlib
    import sys
    import types

    calls = []
    monkeypatch.setitem(sys.modules, "lm_eval", types.SimpleNamespace(simple_evaluate=lambda **kw: calls.append(kw)))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "lm_eval" else real(name, *a))
    path = tmp_path / name / "hf"
    src = types.SimpleNamespace(no_hf="", kind="decoder", hf_dir=lambda: contextlib.nullcontext(path))
    line, results = run_harness(src, "t")  # type: ignore[arg-type]
    assert line == f"harness: {path}: lm_eval's model_args cannot carry ',' or '=' in a path; skipped t"
    assert results is None and not calls


def test_the_harness_skips_an_encoder(tmp_path, monkeypatch):
    """lm_eval's "hf" model loads AutoModelForCausalLM, which maps a BERT export to BertLMHeadModel: every weight
    loads and a bidirectional model would be scored as a causal one. An encoder is skipped with a line."""
    import contextlib
    import sys
    import types

    calls = []
    monkeypatch.setitem(sys.modules, "lm_eval", types.SimpleNamespace(simple_evaluate=lambda **kw: calls.append(kw)))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "lm_eval" else real(name, *a))
    hf = contextlib.nullcontext(tmp_path)
    src = types.SimpleNamespace(no_hf="", kind="encoder", label="run R (step 4)", hf_dir=lambda: hf)
    line, results = run_harness(src, "t")  # type: ignore[arg-type]
    assert line == "harness: run R (step 4) is a masked LM; lm-evaluation-harness scores causal LMs; skipped tasks t"
    assert results is None and not calls


def test_a_run_without_validation_is_evaluated_on_the_default_count(tokenizer_dir, workdir):
    """``train.val_sequences: 0`` (no validation while training) still evaluates: 64 sequences unless told."""
    from eval.evaluate import DEFAULT_SEQUENCES

    cfg = small_run_config(workdir, tokenizer_dir, AGREE["llama-decoder"], ["train.val_sequences=0"])
    ckpt = write_checkpoint(workdir / "run", cfg, perturbed_state(cfg.model, seed=1), tokenizer_dir, 4)
    out = evaluate(str(ckpt), sample=False)
    assert 0 < out["sequences"] <= DEFAULT_SEQUENCES and out["tokens"] > 0
    assert evaluate(str(ckpt), sequences=3, sample=False)["sequences"] == 3


def test_token_shards_of_another_tokenizer_are_refused(tokenizer_dir, workdir):
    """``--data`` token shards made with a tokenizer of another vocabulary than the model's: one line, not a score of
    ids that mean other tokens."""
    from pretrain.config import ConfigError
    from pretrain.data.tokenizer import train_tokenizer
    from tests.conftest import corpus_lines
    from tests.unit.data.shards.common import build_shards

    cfg = small_run_config(workdir, tokenizer_dir, AGREE["llama-decoder"])
    ckpt = write_checkpoint(workdir / "run", cfg, perturbed_state(cfg.model, seed=1), tokenizer_dir, 4)
    other = train_tokenizer(corpus_lines(300), 300)
    other.save_pretrained(str(workdir / "other-tok"))
    text = workdir / "text.txt"
    text.write_text("\n".join(corpus_lines(400)[:200]) + "\n", encoding="utf-8")
    build_shards(workdir / "shards", [text], other, workdir / "other-tok")
    with pytest.raises(ConfigError, match=rf"^--data {workdir / 'shards'}: token shards of a tokenizer of 300 tokens;"):
        evaluate(str(ckpt), data=[str(workdir / "shards")], sample=False)
