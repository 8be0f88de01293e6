"""Hugging Face export: targets, parity over the option grid through the written directory, tokenizer fidelity.
Import (export -> import -> export) is in ``test_hf_import.py``; the CLI and the export of a real ZeRO-3
checkpoint written by two gloo workers (registered in MLflow) in ``tests/integration/checkpoint/test_export.py``;
the key maps alone and the exact rewrites in ``test_families.py``."""

from __future__ import annotations

import dataclasses
import itertools
import json
import shutil
from pathlib import Path

import pytest
import torch

from pretrain.checkpoint import layout as ly
from pretrain.checkpoint import store as ck
from pretrain.checkpoint.manifest import Manifest
from pretrain.config import ModelConfig, RunConfig, dump_yaml, load_config
from pretrain.export import families as fam
from pretrain.export.hf import export_model, export_target, load_exported, read_hf_state_dict
from pretrain.export.parity import (
    PROBE_TEXTS,
    ExportError,
    check_tokenizer,
    logits_max_abs_diff,
    our_model,
    parity_batch,
    parity_on,
)
from pretrain.model import build_model
from tests.conftest import WIKITEXT, corpus_lines
from tests.harness import tiny_model

V, D, L, T = 512, 32, 2, 16


# ----------------------------------------------------------------------------------------------
# Helpers shared with tests/unit/eval/test_evaluate.py and tests/integration/checkpoint/test_export.py
# (the tokenizer fixtures are in conftest.py)
# ----------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: thread synchronization would dominate (each op is microseconds)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny(*presets: dict, **kw) -> ModelConfig:
    base = dict(vocab_size=V, hidden_size=D, num_layers=L, num_heads=4, max_seq_len=T)
    for preset in presets:
        base.update(preset)
    base.update(kw)
    return ModelConfig(**base)


def perturbed_state(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Weights with non-trivial norms and biases too (init leaves them 1/0, which would hide map bugs)."""
    model = build_model(cfg, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model.state_dict()


def write_checkpoint(
    run_dir: Path, cfg: RunConfig, sd: dict, tokenizer_dir: Path, step: int, run_id: str = "local-test"
) -> Path:
    """A committed single-process checkpoint in DeepSpeed's stage-0 layout (module state of rank 0)."""
    assert cfg.zero.stage == 0
    stage = ly.staging_dir(run_dir, step, ck.new_nonce())
    (stage / ly.DS_DIR / ly.DS_TAG).mkdir(parents=True)
    torch.save({"module": sd}, stage / ly.DS_DIR / ly.DS_TAG / "mp_rank_00_model_states.pt")
    ck.write_json(stage / ly.data_file(0), {"streams": {}})
    (stage / ly.CONFIG).write_text(dump_yaml(cfg))
    shutil.copytree(tokenizer_dir, stage / ly.TOKENIZER)
    return ck.commit(stage, run_dir, Manifest(step=step, world_size=1, run_id=run_id))


def safetensors_of(path: Path) -> dict[str, torch.Tensor]:
    return read_hf_state_dict(path)


# ----------------------------------------------------------------------------------------------
# Targets
# ----------------------------------------------------------------------------------------------

LLAMA_CFG = dict(norm="rmsnorm", activation="swiglu", position="rotary", norm_placement="pre")
GPT2_CFG = dict(norm="layernorm", activation="gelu", position="learned", norm_placement="pre")
BERT_CFG = dict(
    kind="encoder",
    norm="layernorm",
    activation="gelu",
    position="learned",
    norm_placement="post",
    embedding_norm=True,
    mlm_head_transform=True,
    bias=True,
)


def test_export_target():
    assert export_target(tiny(LLAMA_CFG, num_kv_heads=2))[0] == "LlamaForCausalLM"
    assert export_target(tiny(GPT2_CFG))[0] == "GPT2LMHeadModel"
    assert export_target(tiny(BERT_CFG))[0] == "BertForMaskedLM"
    cls, why = export_target(tiny(BERT_CFG, norm_placement="deepnorm"))
    assert cls == "BertForMaskedLM" and "DeepNorm" in why
    # No exact standard class: explained, and exported with trust_remote_code.
    cls, why = export_target(tiny(GPT2_CFG, bias=True))
    assert cls is None and "LM head has no bias: set model.lm_head_bias=false" in why and "trust_remote_code" in why
    gpt = load_config(Path(__file__).parents[3] / "configs" / "gpt-125m.yaml")  # the GPT-2-style preset
    assert export_target(gpt.model, gpt.moe)[0] == "GPT2LMHeadModel"
    cls, why = export_target(tiny(kind="encoder", norm_placement="pre"))
    assert cls is None and "BertForMaskedLM" in why and "PretrainTransformerForMaskedLM" in why
    assert export_target(tiny(LLAMA_CFG, norm_placement="sandwich"))[0] is None
    assert export_target(tiny(LLAMA_CFG, final_norm=False))[0] is None


# ----------------------------------------------------------------------------------------------
# Parity through the written directory, over the option grid
# ----------------------------------------------------------------------------------------------

GRID = list(
    itertools.product(
        ["decoder", "encoder"],
        ["pre", "post", "deepnorm", "sandwich"],
        ["layernorm", "rmsnorm"],
        ["learned", "rotary"],
        ["gelu", "swiglu"],
        [True, False],
    )
)


def grid_cfg(kind, placement, norm, position, activation, tied) -> ModelConfig:
    # Secondary options ride along so each is covered both ways, and the exact families are hit.
    return tiny(
        kind=kind,
        norm_placement=placement,
        norm=norm,
        position=position,
        activation=activation,
        tie_embeddings=tied,
        num_kv_heads=2 if (position == "rotary") != tied else 0,
        bias=position == "learned" and (kind == "encoder" or not tied),
        embedding_norm=kind == "encoder" and position == "learned",
        mlm_head_transform=kind == "encoder" and activation == "gelu",
        final_norm=not (placement == "sandwich" and norm == "layernorm"),
        dropout=0.1,
    )


NAMED = {  # the exact families with their option combinations
    "llama-untied-gqa": (tiny(LLAMA_CFG, tie_embeddings=False, num_kv_heads=2), "LlamaForCausalLM"),
    "llama-tied-mha": (tiny(LLAMA_CFG, tie_embeddings=True, rope_theta=500.0, norm_eps=1e-6), "LlamaForCausalLM"),
    "llama-mqa": (tiny(LLAMA_CFG, num_kv_heads=1, ffn_size=48), "LlamaForCausalLM"),
    "gpt2-tied": (tiny(GPT2_CFG, tie_embeddings=True), "GPT2LMHeadModel"),
    "gpt2-untied-gqa": (tiny(GPT2_CFG, tie_embeddings=False, num_kv_heads=2), "GPT2LMHeadModel"),
    "bert-tied": (tiny(BERT_CFG), "BertForMaskedLM"),
    "bert-untied-nobias-gqa": (tiny(BERT_CFG, bias=False, tie_embeddings=False, num_kv_heads=2), "BertForMaskedLM"),
    "bert-deepnorm": (tiny(BERT_CFG, norm_placement="deepnorm", num_layers=3), "BertForMaskedLM"),
    "gpt2-biases-but-the-heads": (tiny(GPT2_CFG, bias=True, lm_head_bias=False), "GPT2LMHeadModel"),
    "bert-no-head-bias": (tiny(BERT_CFG, lm_head_bias=False), "BertForMaskedLM"),
    "remote-gpt2-with-bias": (tiny(GPT2_CFG, bias=True), "PretrainTransformerForCausalLM"),
    "remote-llama-head-bias": (tiny(LLAMA_CFG, lm_head_bias=True), "PretrainTransformerForCausalLM"),
    "remote-prenorm-rotary-encoder": (
        tiny(kind="encoder", activation="swiglu", norm="rmsnorm"),
        "PretrainTransformerForMaskedLM",
    ),
}


def _export_and_check(
    cfg: ModelConfig, tokenizer, out: Path, expected: str | None = None, recheck: bool = True
) -> float:
    sd = perturbed_state(cfg)
    report = export_model(cfg, sd, tokenizer, out, log=lambda *a: None)
    if expected:
        assert report.hf_class == expected
    meta = json.loads((out / "pretrain_export.json").read_text())
    assert meta["hf_class"] == report.hf_class and meta["standard_class"] == (export_target(cfg)[0] is not None)
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert ("generation_config.json" in names) == (cfg.kind == "decoder")
    assert ("modeling_pretrain.py" in names) == (not report.standard)
    assert report.max_abs_diff <= 1e-4
    if not recheck:
        return report.max_abs_diff
    # Independent re-check (the export already checked): a fresh load of the directory, another batch.
    loaded = load_exported(out, cfg.kind)
    assert type(loaded).__name__ == report.hf_class
    diff = logits_max_abs_diff(our_model(cfg, sd), loaded, parity_batch(cfg, seed=7))
    assert diff <= 1e-4
    return max(diff, report.max_abs_diff)


@pytest.mark.parametrize("name", list(NAMED))
def test_parity_exact_families(name, tokenizer, tmp_path):
    cfg, expected = NAMED[name]
    diff = _export_and_check(cfg, tokenizer, tmp_path / "hf", expected)
    print(f"\n{name} -> {expected}: max |logits diff| = {diff:.2e}")


def _grid_class(cfg: ModelConfig) -> str:
    """The class an export of ``cfg`` is written as: the standard one, else the bundled modeling file's."""
    return export_target(cfg)[0] or (
        "PretrainTransformerForCausalLM" if cfg.kind == "decoder" else "PretrainTransformerForMaskedLM"
    )


@pytest.mark.parametrize("kind,placement", sorted({combo[:2] for combo in GRID}))
def test_parity_option_grid(kind, placement, tokenizer, tmp_path):
    """All 128 combinations of kind x placement x norm x position x activation x tying (plus GQA, biases,
    embedding norm, head transform, final norm riding along), each through a written directory, as the class
    :func:`_grid_class` names (8 parts of 16, so that parallel workers share them)."""
    worst = 0.0
    for i, combo in enumerate(c for c in GRID if c[:2] == (kind, placement)):
        cfg = grid_cfg(*combo)
        out = tmp_path / f"hf{i}"
        worst = max(worst, _export_and_check(cfg, tokenizer, out, recheck=False))
        assert json.loads((out / "pretrain_export.json").read_text())["hf_class"] == _grid_class(cfg), combo
        shutil.rmtree(out)
    print(f"\n{kind} {placement}: worst max |logits diff| = {worst:.2e}")


def test_the_option_grid_reaches_every_export_class():
    assert {_grid_class(grid_cfg(*combo)) for combo in GRID} == {
        "LlamaForCausalLM",
        "GPT2LMHeadModel",
        "BertForMaskedLM",
        "PretrainTransformerForCausalLM",
        "PretrainTransformerForMaskedLM",
    }


def test_standard_exports_load_without_remote_code(tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, AutoTokenizer

    cfg, _ = NAMED["llama-untied-gqa"]
    export_model(cfg, perturbed_state(cfg), tokenizer, tmp_path / "llama", log=lambda *a: None)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "llama"))  # no trust_remote_code
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_key_value_heads == 2
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "llama"))
    assert tok("Hello world", add_special_tokens=False)["input_ids"] == tokenizer("Hello world")["input_ids"]
    gen = json.loads((tmp_path / "llama" / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tokenizer.eos_token_id
    cfg, _ = NAMED["bert-tied"]
    export_model(cfg, perturbed_state(cfg), tokenizer, tmp_path / "bert", log=lambda *a: None)
    bert = AutoModelForMaskedLM.from_pretrained(str(tmp_path / "bert"))
    assert bert.cls.predictions.decoder.weight is bert.bert.embeddings.word_embeddings.weight  # tied


def test_parity_failure_is_detected_and_nothing_is_written(tokenizer, tmp_path, monkeypatch):
    cfg, _ = NAMED["llama-untied-gqa"]
    original = fam.LLAMA.rules

    def swapped(c):  # a wrong map: q and k exchanged
        rules = original(c)
        return [
            dataclasses.replace(
                r, theirs=r.theirs.replace("q_proj", "TMP").replace("k_proj", "q_proj").replace("TMP", "k_proj")
            )
            if "_proj" in r.theirs
            else r
            for r in rules
        ]

    monkeypatch.setattr(fam, "LLAMA", dataclasses.replace(fam.LLAMA, rules=swapped))
    monkeypatch.setattr(fam, "FAMILIES", (fam.LLAMA, fam.GPT2, fam.BERT))
    cfg = dataclasses.replace(cfg, num_kv_heads=0)  # same shapes, so only parity can catch it
    with pytest.raises(ExportError, match="parity failed"):
        export_model(cfg, perturbed_state(cfg), tokenizer, tmp_path / "bad", log=lambda *a: None)
    assert not (tmp_path / "bad").exists() and not list(tmp_path.iterdir())


def test_parity_runs_on_the_device_asked_for_and_refuses_a_missing_one(monkeypatch):
    """``export --device``: the check moves both models and the batch there (fp32, TF32 restored after); a CUDA
    device where none exists, or a name that is no device, is refused in one line (ConfigError: exit 2)."""
    from pretrain.config import ConfigError
    from pretrain.export.hf import main
    from tests.harness import tiny_config

    cfg = tiny_config().model
    sd = build_model(cfg, 0).state_dict()
    ours, twin = our_model(cfg, sd), our_model(cfg, {k: v.clone() for k, v in sd.items()})
    with torch.no_grad():
        twin.lm_head.weight.add_(1e-3)  # a model whose logits differ
    ids = parity_batch(cfg)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    assert parity_on("cpu", ours, twin, ids) == logits_max_abs_diff(ours, twin, ids) > 0
    assert torch.backends.cuda.matmul.allow_tf32 == tf32
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="no CUDA device"):
        parity_on("cuda", ours, twin, ids)
    with pytest.raises(ConfigError, match="is not cpu, cuda or cuda:N"):
        main(["RUN", "--out", "x", "--device", "gpu"])


def test_out_dir_guard(tokenizer, tmp_path):
    from pretrain.config import ConfigError

    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "notes.txt").write_text("keep me")
    cfg, _ = NAMED["gpt2-tied"]
    with pytest.raises(ConfigError, match="not an earlier export"):
        export_model(cfg, perturbed_state(cfg), tokenizer, tmp_path / "precious", log=lambda *a: None)
    # An earlier export is replaced.
    export_model(cfg, perturbed_state(cfg), tokenizer, tmp_path / "hf", log=lambda *a: None)
    export_model(cfg, perturbed_state(cfg, seed=1), tokenizer, tmp_path / "hf", log=lambda *a: None)


def test_sharded_export(tokenizer, tmp_path):
    cfg = tiny(LLAMA_CFG, tie_embeddings=False)
    report = export_model(
        cfg, perturbed_state(cfg), tokenizer, tmp_path / "hf", max_shard_size="20KB", log=lambda *a: None
    )
    assert report.shards > 2 and (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    assert report.max_abs_diff <= 1e-4


# ----------------------------------------------------------------------------------------------
# Tokenizer fidelity and generation
# ----------------------------------------------------------------------------------------------


def test_tokenizer_fidelity_on_corpus(tokenizer, tmp_path):
    if not WIKITEXT.is_file():
        pytest.skip(f"{WIKITEXT} not present")
    from transformers import AutoTokenizer

    cfg, _ = NAMED["gpt2-tied"]
    export_model(cfg, perturbed_state(cfg), tokenizer, tmp_path / "hf", log=lambda *a: None)
    exported = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    lines = WIKITEXT.read_text(encoding="utf-8").splitlines()[:3000]  # blank lines and " = Heading = " included
    extra = [line + "<|endoftext|>" + line[::-1] for line in lines[:200]] + PROBE_TEXTS
    n = check_tokenizer(tokenizer, exported, lines + extra)
    non_ascii = sum(any(ord(c) > 127 for c in t) for t in lines + extra)
    print(f"\ntokenizer fidelity: {n} texts identical ({non_ascii} with non-ASCII characters)")
    assert n == len(lines) + len(extra) and non_ascii > 0
    assert exported.decode(exported("Ünïcödé  x\n", add_special_tokens=False)["input_ids"]) == "Ünïcödé  x\n"
    # the model's context is the tokenizer's: truncation keeps what the model can take (learned positions)
    assert exported.model_max_length == cfg.max_seq_len
    assert len(exported(" ".join(lines[:50]), truncation=True)["input_ids"]) == cfg.max_seq_len


@pytest.mark.parametrize("name", ["llama-untied-gqa", "remote-gpt2-with-bias"])
def test_greedy_generate_matches_our_argmax(name, tokenizer, tmp_path):
    cfg, _ = NAMED[name]
    sd = perturbed_state(cfg)
    export_model(cfg, sd, tokenizer, tmp_path / "hf", log=lambda *a: None)
    hf = load_exported(tmp_path / "hf", "decoder")
    ours = our_model(cfg, sd)
    ids = parity_batch(cfg, batch=1, seq_len=4)
    out = hf.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=8,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
    )
    ref = ids
    with torch.no_grad():
        for _ in range(8):
            ref = torch.cat([ref, ours(ref).logits[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(out, ref)


def test_foreign_remote_code_is_not_trusted(tokenizer, tmp_path):
    cfg, _ = NAMED["remote-gpt2-with-bias"]
    export_model(cfg, perturbed_state(cfg), tokenizer, tmp_path / "hf", log=lambda *a: None)
    code = tmp_path / "hf" / "modeling_pretrain.py"
    code.write_text(code.read_text() + "\nimport os  # something else\n")
    with pytest.raises(ValueError, match="differs from this version"):
        load_exported(tmp_path / "hf", "decoder")


# ----------------------------------------------------------------------------------------------
# Run configs of checkpoints (the CLI and registry tests are in tests/integration/checkpoint/test_export.py)
# ----------------------------------------------------------------------------------------------


def small_run_config(tmp: Path, tokenizer_dir: Path, model: list[str], extra: list[str] = ()) -> RunConfig:
    """A run config whose validation data is a file of corpus lines (for export metadata and eval)."""
    val = tmp / "val.txt"
    if not val.is_file():
        val.write_text("\n".join(corpus_lines(3000)[-600:]) + "\n", encoding="utf-8")
    return load_config(
        None,
        [
            *tiny_model(max_seq_len=32, vocab_size=V),
            "zero.stage=0",
            f"data.tokenizer={tokenizer_dir}",
            f"data.sources=[{{path: '{val}'}}]",
            f"data.val_sources=[{{path: '{val}'}}]",
            "train.val_sequences=16",
            *model,
            *extra,
        ],
    )


@pytest.mark.parametrize("override", [{"qk_norm": True}, {"embedding_scale": 0.0}])
def test_unrepresentable_stabilizers_are_refused_up_front(override, tmp_path):
    import dataclasses

    from pretrain.config import ModelConfig
    from pretrain.export.hf import ExportError, export_model, export_target

    cfg = dataclasses.replace(
        ModelConfig(vocab_size=97, num_layers=1, hidden_size=32, num_heads=2, max_seq_len=16), **override
    )
    hf_class, reason = export_target(cfg)
    assert hf_class is None and reason.startswith("cannot export")
    with pytest.raises(ExportError, match="cannot export"):
        export_model(cfg, {}, None, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("override", [{"qk_norm": True}, {"embedding_scale": 2.0}])
def test_to_hf_model_refuses_what_no_class_represents(override, tokenizer):
    """A Llama-shaped model with a stabilizer Llama lacks: refused in one line, never built approximately."""
    from pretrain.export.hf import special_token_ids, to_hf_model

    cfg = tiny(LLAMA_CFG, **override)
    with pytest.raises(ExportError, match=f"^cannot export: model.{next(iter(override))} is not represented") as e:
        to_hf_model(cfg, perturbed_state(cfg), special_token_ids(tokenizer, cfg.kind))
    assert "\n" not in str(e.value)
