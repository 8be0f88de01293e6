"""Hugging Face export through the CLI (a checkpoint directory, and its errors) and of real DeepSpeed ZeRO-1/3
checkpoints written by two gloo workers: consolidation gives the engines' weights, ``export --register``
registers the model in MLflow by run id, and ``generate`` samples from the run and from its export (self-speculative
greedy identical to plain greedy, also in plain ``transformers``) and refuses bad input in one line."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from pretrain.checkpoint import layout as ly
from pretrain.checkpoint import store as ck
from pretrain.checkpoint.manifest import Manifest
from pretrain.config import dump_yaml, load_config
from pretrain.export.parity import our_model, parity_batch
from pretrain.model import build_model
from tests.conftest import cli_env
from tests.harness import cli, run_distributed
from tests.unit.export.test_hf import (  # noqa: F401 - fixtures are used by name
    BERT_CFG,
    one_thread,
    perturbed_state,
    small_run_config,
    write_checkpoint,
)


def run_cli(cwd: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """``cli`` (exit 0) with one thread per process: tiny models, threads only add synchronization."""
    return cli(cwd, *args, timeout=timeout, env={**cli_env(cwd), "OMP_NUM_THREADS": "1"})


def test_cli_export_from_checkpoint_and_errors(tokenizer_dir, workdir, capsys):
    tmp_path = workdir
    cfg = small_run_config(tmp_path, tokenizer_dir, ["model.norm=rmsnorm", "model.activation=swiglu"])
    run_dir = tmp_path / "run"
    for step in (3, 6):
        write_checkpoint(run_dir, cfg, perturbed_state(cfg.model, seed=step), tokenizer_dir, step)
    proc = run_cli(tmp_path, "export", str(run_dir), "--out", "hf", "--step", "3")
    print(proc.stdout)
    assert "LlamaForCausalLM" in proc.stdout and "step 3" in proc.stdout
    diff = float(re.search(r"max \|logits diff\| = (\S+)", proc.stdout).group(1))
    assert diff <= 1e-4
    meta = json.loads((tmp_path / "hf" / "pretrain_export.json").read_text())
    assert meta["source"]["step"] == 3 and meta["max_seq_len"] == 32
    # Errors: one line on stderr, config errors exit 2 (in-process: the same CLI entry point).
    from pretrain.cli import main

    for args, message in [
        (["no-such-run", "--out", "x"], "neither a checkpoint"),
        ([str(run_dir), "--out", "x", "--step", "4"], "committed: 3, 6"),
        ([str(run_dir)], "--out"),
    ]:
        assert main(["export", *args]) == 2
        err = capsys.readouterr().err  # (MLflow may log its own INFO lines when it creates the store)
        errors = [line for line in err.splitlines() if "error" in line.lower()]
        assert len(errors) == 1 and errors[0].startswith("error:") and message in errors[0], err
        assert "Traceback" not in err


# --- Real DeepSpeed ZeRO-3 checkpoint of a 2-worker run ------------------------------------------


def _zero_worker(rank: int, world: int, jobs: list[tuple[str, str, str]], step_count: int) -> list:
    """For each (run_dir, config YAML, nonce): train ``step_count`` steps with DeepSpeed, save the engine
    into the staging dir, and return the engine's logits on a probe batch (rank 0)."""
    import torch.distributed as tdist
    import yaml

    from pretrain.train.module import build_module
    from pretrain.train.step import StepInput, run_step

    torch.set_num_threads(1)
    out = []
    for run_dir, cfg_yaml, nonce in jobs:
        cfg = load_config(None, base=yaml.safe_load(cfg_yaml))
        assert cfg.train.seed == 5 and cfg.train.precision == "fp32"
        module = build_module(cfg)
        engine = module.engine
        g = torch.Generator().manual_seed(11)
        G, per = cfg.train.global_batch_size, cfg.train.global_batch_size // world
        assert module.plan.micro_batch == cfg.train.micro_batch_size and module.plan.shares == (per,) * world
        for step in range(step_count):
            ids = torch.randint(0, cfg.model.vocab_size, (G, cfg.model.max_seq_len), generator=g)
            shard = ids[rank * per : (rank + 1) * per]
            run_step(module, StepInput(step + 1, {"input_ids": shard, "labels": shard}, module.lr_at(step)))
        engine.eval()
        with torch.no_grad():  # (ZeRO-3 gathers the partitioned weights for the forward)
            logits = engine(parity_batch(cfg.model, seed=3)).logits.clone()
        stage = ly.staging_dir(Path(run_dir), step_count, nonce)
        module.save(stage / ly.DS_DIR)
        ck.write_json(stage / ly.data_file(rank), {"streams": {}})
        tdist.barrier()
        # Plain lists: a tensor would travel as a shared-memory handle that dies with this process.
        out.append(logits.tolist() if rank == 0 else None)
    return out


def test_export_zero_two_worker_checkpoints_and_register(tokenizer_dir, tmp_path, monkeypatch, capsys):
    pytest.importorskip("deepspeed")
    from mlflow import MlflowClient

    from pretrain.export.checkpoints import consolidated_state_dict
    from pretrain.export.hf import export_checkpoint
    from pretrain.train import tracking

    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    dist_opts = [
        "cluster.num_workers=2",
        "data.num_streams=2",
        "train.global_batch_size=8",
        "train.micro_batch_size=4",
        "train.lr=1e-2",
        "train.warmup_steps=1",
        "train.precision=fp32",
        "train.seed=5",
    ]
    cfg = small_run_config(
        tmp_path,
        tokenizer_dir,
        ["model.norm=rmsnorm", "model.activation=swiglu", "model.num_kv_heads=2", "model.tie_embeddings=false"],
        ["zero.stage=3", *dist_opts],
    )
    enc_cfg = small_run_config(
        tmp_path,
        tokenizer_dir,
        [f"model.{k}={str(v).lower()}" for k, v in BERT_CFG.items()],
        ["zero.stage=1", *dist_opts],
    )
    run_id = tracking.start_run(uri, cfg)
    run_dir, enc_dir = tmp_path / "checkpoints" / run_id, tmp_path / "checkpoints" / "encoder-run"
    run_dir.mkdir(parents=True)
    enc_dir.mkdir(parents=True)
    tracking.Tracker(uri, run_id).set_tags({tracking.TAG_CKPT_ROOT: str(run_dir)})

    jobs = [(str(run_dir), dump_yaml(cfg), ck.new_nonce()), (str(enc_dir), dump_yaml(enc_cfg), ck.new_nonce())]
    engine_logits = run_distributed(_zero_worker, 2, jobs, 2, fresh=False)[0]
    ckpts = []
    for (rdir, cfg_yaml, nonce), c in zip(jobs, (cfg, enc_cfg)):
        stage = ly.staging_dir(Path(rdir), 2, nonce)
        (stage / ly.CONFIG).write_text(cfg_yaml)
        shutil.copytree(tokenizer_dir, stage / ly.TOKENIZER)
        ckpts.append(
            ck.commit(stage, Path(rdir), Manifest(step=2, world_size=2, run_id=run_id if c is cfg else "local-enc"))
        )
        assert len(list((ckpts[-1] / "ds" / "state").glob("*optim_states.pt"))) == 2  # really partitioned

    # Consolidation gives the weights the engines computed with.
    for ckpt, c, ref in zip(ckpts, (cfg, enc_cfg), engine_logits):
        sd = consolidated_state_dict(ckpt, zero_stage=c.zero.stage)
        with torch.no_grad():
            got = our_model(c.model, sd)(parity_batch(c.model, seed=3)).logits
        consolidation_diff = (got - torch.tensor(ref)).abs().max().item()
        print(f"\nZeRO-{c.zero.stage} consolidation vs engine logits: max |diff| = {consolidation_diff:.2e}")
        assert consolidation_diff < 1e-5
        assert not torch.equal(
            sd["blocks.0.attn.q_proj.weight"], build_model(c.model, 5).state_dict()["blocks.0.attn.q_proj.weight"]
        ), "training must have changed the weights"
    ckpt = ckpts[0]
    report = export_checkpoint(str(enc_dir), tmp_path / "encoder-hf", log=lambda *a: None)
    assert report.hf_class == "BertForMaskedLM" and report.max_abs_diff <= 1e-4

    for version in (1, 2):  # by run id, registered twice: versions increase
        proc = run_cli(tmp_path, "export", run_id, "--out", "exported", "--register", "tiny-llama")
        print(proc.stdout)
        assert "ZeRO-3, 2 worker(s)" in proc.stdout and "LlamaForCausalLM" in proc.stdout
        assert float(re.search(r"max \|logits diff\| = (\S+)", proc.stdout).group(1)) <= 1e-4
        assert f"registered tiny-llama version {version} (run {run_id}, step 2)" in proc.stdout
    mv = MlflowClient(tracking_uri=uri, registry_uri=uri).get_model_version("tiny-llama", "2")
    assert mv.run_id == run_id and mv.tags["pretrain.step"] == "2" and mv.tags["pretrain.checkpoint"] == str(ckpt)
    assert mv.source == (tmp_path / "exported").resolve().as_uri()
    assert not list(Path(tmp_path / "mlartifacts").rglob("*.safetensors"))  # weights never went through MLflow

    # generate: the run by id through the launcher; self-speculative greedy equals plain greedy token for token.
    prompt = ["--prompt", "The history of the", "--max-new-tokens", "12", "--early-exit", "1", "--draft-tokens", "3"]
    r = json.loads(run_cli(tmp_path, "generate", run_id, *prompt, "--json").stdout)
    assert r["hf_class"] == "LlamaForCausalLM" and r["step"] == 2 and r["layers"] == 2 and r["greedy"]
    assert r["new_tokens"] > 0 and r["tokens_per_s"] > 0
    e = r["early_exit"]
    assert e["identical"] and e["continuation"] == r["continuation"] and e["new_tokens"] == r["new_tokens"]
    assert e["accepted"] + e["verify_passes"] == e["new_tokens"] and 0 <= e["accepted"] <= e["drafted"]
    from pretrain.cli import main

    capsys.readouterr()
    assert main(["generate", str(tmp_path / "exported"), *prompt, "--json"]) == 0
    from_export = json.loads(capsys.readouterr().out)
    assert from_export["continuation"] == r["continuation"] and from_export["early_exit"]["identical"]
    assert main(["generate", str(tmp_path / "exported"), *prompt]) == 0
    table = capsys.readouterr().out
    assert "identical to plain greedy" in table and "acceptance rate" in table and "tokens/s" in table

    # The export in plain transformers (no custom code): assistant_early_exit gives the plain greedy tokens.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "exported"))
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "exported"))
    ids = tok("The history of the", return_tensors="pt", add_special_tokens=False).input_ids
    greedy = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(model.generate(ids, max_new_tokens=12, do_sample=False, assistant_early_exit=1), greedy)
    assert tok.decode(greedy[0, ids.shape[1] :]) == r["continuation"]

    # Bad input: one line, exit 2.
    for args, message in [
        ([run_id, "--prompt", "x", "--early-exit", "2"], "below the model's depth (2 layers)"),
        ([str(tmp_path / "exported"), "--prompt", "x", "--early-exit", "0"], "below the model's depth (2 layers)"),
        ([str(enc_dir), "--prompt", "x"], "is an encoder (masked LM)"),
        ([str(tmp_path / "encoder-hf"), "--prompt", "x"], "is an encoder (masked LM)"),
        ([run_id, "--prompt", "history " * 40], "the model's context is 32 tokens"),
        ([str(tmp_path / "no-such-dir"), "--prompt", "x"], "no such checkpoint"),
        (["no-such-run", "--prompt", "x"], "neither a checkpoint"),
    ]:
        assert main(["generate", *args]) == 2, args
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if "error" in line.lower()]
        assert len(errors) == 1 and errors[0].startswith("error:") and message in errors[0], err
