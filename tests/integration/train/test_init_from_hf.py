"""A run started from a Hugging Face model (``model.init_from_hf``) through the command line, then resumed: the run
takes the directory's architecture and tokenizer and keeps its own training choices (z-loss); its first step starts
from the imported weights (the converted copy in the run directory), which a resume no longer needs and removes."""

from __future__ import annotations

from pathlib import Path

from pretrain.export.checkpoints import resolve_checkpoint
from tests.harness import CONFIG, cli, run_id_of

RUN = [
    "model.z_loss=0.0001",
    "data.num_streams=2",
    "train.global_batch_size=8",
    "train.micro_batch_size=4",
    "train.max_steps=2",
    "train.warmup_steps=1",
    "train.log_every=1",
    "train.val_every=0",
    "train.val_sequences=8",
    "checkpoint.every_steps=2",
    "cluster.num_workers=1",
    "cluster.use_ray=false",
    "stability.plot_at_end=false",
]


def test_a_run_from_a_hugging_face_model_trains_resumes_and_keeps_its_choices(tokenizer, tmp_path):
    import transformers

    hf = tmp_path / "hf-llama"
    source = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=32,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=64,
            max_position_embeddings=64,
            tie_word_embeddings=False,
        )
    )
    source.save_pretrained(str(hf))
    tokenizer.save_pretrained(str(hf))
    out = cli(tmp_path, "train", CONFIG, *RUN, f"model.init_from_hf={hf}").stdout
    assert f"initializing from Hugging Face model {hf}" in out
    run_id = run_id_of(out)
    run_dir = tmp_path / "checkpoints" / run_id
    assert (run_dir / "init_weights.pt").is_file()
    loaded = resolve_checkpoint(str(run_dir / "step_00000002"))
    cfg, model = loaded.config, loaded.config.model
    # two steps from the imported weights, not from an initialization of the run's own (std 0.02: ~0.1 apart)
    start, trained = source.model.embed_tokens.weight.detach(), loaded.state_dict()["embed_tokens.weight"]
    assert (trained[: len(start)] - start).abs().max() < 0.01
    assert (model.num_layers, model.hidden_size, model.num_kv_heads, model.z_loss) == (3, 32, 2, 0.0001)
    assert Path(cfg.data.tokenizer).is_dir() and model.vocab_size >= len(tokenizer)

    cli(tmp_path, "resume", run_id, "train.max_steps=4")
    assert (run_dir / "step_00000004" / "manifest.json").is_file()
    assert not (run_dir / "init_weights.pt").exists(), "a checkpoint holds the run: the converted copy is removed"
