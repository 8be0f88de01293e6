"""Growth operators (pure functions on state dicts): which ones preserve the function exactly, and for which
architectures; the shapes they produce load into the grown model."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pretrain.config import MoEConfig, load_config
from pretrain.model import build_model
from pretrain.model.growth import add_noise, grow_depth, grow_width, resolve_count, upcycle


def _cfg(*extra: str):
    c = load_config(None, ["model.vocab_size=101", "model.num_layers=2", "model.hidden_size=32",
                           "model.num_heads=4", "model.max_seq_len=16", *extra])
    return c.model, c.moe


def _grown(cfg, moe, state):
    model = build_model(cfg, 123, moe).eval()
    model.load_state_dict(state, strict=True)
    return model


def _ids(kind="decoder"):
    return torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(0))


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


ARCHS = {
    "llama": ["model.norm=rmsnorm", "model.activation=swiglu", "model.position=rotary", "model.num_kv_heads=2"],
    "gpt2": ["model.norm=layernorm", "model.activation=gelu", "model.position=learned", "model.bias=true",
             "model.tie_embeddings=false"],
    "bert": ["model.kind=encoder", "model.norm_placement=post", "model.position=learned", "model.bias=true",
             "model.embedding_norm=true", "model.mlm_head_transform=true"],
    "qk-norm-sandwich": ["model.norm_placement=sandwich", "model.qk_norm=true", "model.norm=rmsnorm"],
    "moe": ["model.norm=rmsnorm", "model.activation=swiglu", "moe.num_experts=4", "moe.top_k=2", "moe.ffn_size=48"],
}


def test_resolve_count():
    assert [resolve_count(s, 4) for s in ("2x", "+4", "6", "1.5x")] == [8, 8, 6, 6]
    with pytest.raises(ValueError, match="factor like 2x"):
        resolve_count("two", 4)


@pytest.mark.parametrize("arch", ARCHS)
def test_width_tile_preserves_the_function_exactly(arch):
    cfg, moe = _cfg(*ARCHS[arch])
    model = build_model(cfg, 0, moe).eval()
    ids = _ids()
    new_cfg, new_moe, sd = grow_width(cfg, moe, model.state_dict(), hidden=64)
    assert (new_cfg.hidden_size, new_cfg.num_heads) == (64, 8)
    grown = _grown(new_cfg, new_moe, sd)
    torch.testing.assert_close(_logits(grown, ids), _logits(model, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "moe"])
def test_ffn_and_heads_grow_exactly_with_net2net(arch):
    cfg, moe = _cfg(*ARCHS[arch], "model.num_kv_heads=0", "model.ffn_size=40")
    model = build_model(cfg, 0, moe).eval()
    ids = _ids()
    new_cfg, new_moe, sd = grow_width(cfg, moe, model.state_dict(), ffn=56, op="net2net", seed=1)
    torch.testing.assert_close(_logits(_grown(new_cfg, new_moe, sd), ids), _logits(model, ids), rtol=1e-5, atol=1e-5)
    cfg2, moe2, sd2 = grow_width(cfg, moe, model.state_dict(), heads=6, hidden=48, ffn=40, op="net2net", seed=1)
    assert cfg2.num_heads == 6 and cfg2.hidden_size == 48
    out = _logits(_grown(cfg2, moe2, sd2), ids)
    assert out.shape == (2, 16, 101) and torch.isfinite(out).all()  # hidden via net2net: approximate (norms)


@pytest.mark.parametrize("placement", ["pre", "sandwich"])
def test_depth_identity_is_exact_and_stack_interleave_copy_blocks(placement):
    cfg, moe = _cfg(f"model.norm_placement={placement}", "model.bias=true")
    model = build_model(cfg, 0, moe).eval()
    ids, sd = _ids(), model.state_dict()
    c, m, grown = grow_depth(cfg, moe, sd, resolve_count("+3", 2), "identity")
    assert c.num_layers == 5
    torch.testing.assert_close(_logits(_grown(c, m, grown), ids), _logits(model, ids), rtol=0, atol=0)
    c, m, stacked = grow_depth(cfg, moe, sd, 4, "stack")
    assert torch.equal(stacked["blocks.2.attn.q_proj.weight"], sd["blocks.0.attn.q_proj.weight"])
    assert torch.equal(stacked["blocks.3.ffn.up_proj.weight"], sd["blocks.1.ffn.up_proj.weight"])
    c, m, inter = grow_depth(cfg, moe, sd, 4, "interleave")
    assert torch.equal(inter["blocks.1.attn.q_proj.weight"], sd["blocks.0.attn.q_proj.weight"])
    assert torch.equal(inter["blocks.2.attn.q_proj.weight"], sd["blocks.1.attn.q_proj.weight"])
    _grown(c, m, inter)


def test_depth_identity_refused_where_it_cannot_be_exact_and_moe_layers_follow():
    cfg, moe = _cfg("model.norm_placement=post")
    with pytest.raises(ValueError, match="pre-norm and sandwich"):
        grow_depth(cfg, moe, build_model(cfg, 0, moe).state_dict(), 4, "identity")
    cfg, moe = _cfg(*ARCHS["moe"], "moe.every=2")  # MoE in block 1 only
    c, m, sd = grow_depth(cfg, moe, build_model(cfg, 0, moe).state_dict(), 4, "stack")
    assert m.layers == [1, 3]
    _grown(c, m, sd)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "bert"])
def test_upcycling_preserves_the_function(arch):
    cfg, moe = _cfg(*ARCHS[arch])
    model = build_model(cfg, 0, moe).eval()
    ids = _ids()
    c, m, sd = upcycle(cfg, moe, model.state_dict(), num_experts=4, top_k=2)
    assert m.num_experts == 4 and m.is_moe_layer(0) and m.is_moe_layer(1)
    torch.testing.assert_close(_logits(_grown(c, m, sd), ids), _logits(model, ids), rtol=1e-5, atol=1e-5)


def test_noise_breaks_symmetry_within_its_scale():
    cfg, moe = _cfg(*ARCHS["llama"])
    model = build_model(cfg, 0, moe).eval()
    before = model.state_dict()
    c, m, sd = grow_width(cfg, moe, before, hidden=64)
    noisy = add_noise(before, sd, 1e-3, seed=0)
    w = noisy["blocks.0.attn.q_proj.weight"]
    assert not torch.equal(w[:16], w[16:32]), "the tiled copies differ"
    assert torch.equal(noisy["blocks.0.norm1.weight"], sd["blocks.0.norm1.weight"]), "norms are not perturbed"
    ids = _ids()
    a, b = _logits(_grown(c, m, sd), ids), _logits(_grown(c, m, noisy), ids)
    assert 0 < (a - b).abs().max() < 0.05
    assert add_noise(before, sd, 0.0, 0) is sd


# -- in a running job ------------------------------------------------------------------------------------------

GROW = ["model.num_layers=2", "model.hidden_size=32", "model.num_heads=4", "model.num_kv_heads=2",
        "model.max_seq_len=32", "data.tokenizer_vocab_size=512", "data.tokenizer_train_docs=3000",
        "data.num_streams=2", "train.global_batch_size=8", "train.micro_batch_size=4", "train.max_steps=8",
        "train.warmup_steps=2", "train.log_every=1", "train.val_every=0", "train.val_sequences=8",
        "checkpoint.every_steps=2", "cluster.num_workers=2", "cluster.use_ray=false",
        "stability.plot_at_end=false", "growth.rewarm_steps=2",
        "growth.schedule=[{at_step: 2, depth: 2x, depth_op: identity, noise: 0}, "
        "{at_step: 4, width: 2x, noise: 0}, {at_step: 6, depth: '+1', depth_op: stack}]"]


@pytest.mark.slow
@pytest.mark.parametrize("stage", [3])
def test_growth_schedule_in_a_running_job(tmp_path, stage):
    """2 workers under ZeRO-{stage}, optimizer moments grown with the weights: identity depth growth at step 2 and tiled width growth at step 4 (both exact:
    the held-back loss is unchanged), then a stacked depth growth; the data stream continues; a run stopped at
    step 3 (between the growths) and resumed reproduces the uninterrupted losses bitwise, also on one worker
    after the last growth; the final checkpoint records the grown architecture."""
    from pathlib import Path

    import yaml
    from mlflow import MlflowClient

    from cluster.prepare import prepare_new
    from tests.conftest import ROOT, in_workdir
    from tests.distributed import run_distributed, train_jobs

    cfg_path = ROOT / "configs" / "demo-decoder.yaml"
    opts = GROW + [f"zero.stage={stage}", "growth.optimizer=grow"]  # the AdamW moments grow with the weights
    with in_workdir(tmp_path):
        full = prepare_new(load_config(cfg_path, opts))
        tok = [f"data.tokenizer={Path(full.run_dir) / 'tokenizer'}"]
        part = prepare_new(load_config(cfg_path, opts + tok + ["faults.stop_after_step=3"]))
        run_distributed(train_jobs, 2, [dataclasses.asdict(full), dataclasses.asdict(part)], timeout=900)
        resumed = dataclasses.replace(part, config={**part.config})
        resumed.config["faults"] = {**resumed.config["faults"], "stop_after_step": 7}
        run_distributed(train_jobs, 2, [dataclasses.asdict(resumed)], timeout=900)
        resumed.config["faults"] = {**resumed.config["faults"], "stop_after_step": -1}
        resumed.config["cluster"] = {**resumed.config["cluster"], "num_workers": 1}
        run_distributed(train_jobs, 1, [dataclasses.asdict(resumed)], timeout=900)
        client = MlflowClient()

        def history(run_id, key):
            return {m.step: m.value for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.timestamp)}

        ref, got = history(full.run_id, "train/loss"), history(part.run_id, "train/loss")
        assert sorted(ref) == list(range(1, 9))
        assert all(got[s] == ref[s] for s in range(1, 8)), (ref, got)  # 2 workers, across growths and resumes
        assert abs(got[8] - ref[8]) < 1e-4, "step 8 on one worker: the same global batch"
        before, after = history(full.run_id, "growth/loss_before"), history(full.run_id, "growth/loss_after")
        assert sorted(before) == [2, 4, 6]
        for s in (2, 4):
            assert after[s] == pytest.approx(before[s], rel=1e-5), s
        saved = yaml.safe_load((Path(full.run_dir) / "step_00000008" / "config.yaml").read_text())
        assert (saved["model"]["num_layers"], saved["model"]["hidden_size"], saved["model"]["num_heads"]) == (5, 64, 8)
        assert not saved["model"]["tie_embeddings"], "width growth unties the embeddings"
        small = yaml.safe_load((Path(full.run_dir) / "step_00000002" / "config.yaml").read_text())
        assert small["model"]["num_layers"] == 2, "the checkpoint before a growth keeps the old architecture"
        lr = history(full.run_id, "train/lr")
        assert lr[3] < lr[4] and lr[5] < lr[6], "the LR re-warms after each growth"


@pytest.mark.slow
def test_growth_encoder_zero1_and_upcycling_with_expert_parallelism(tmp_path):
    """2 workers: an encoder (post-norm, learned positions) under ZeRO-1 grows by stacking and by tiled width; a
    decoder under ZeRO-2 is upcycled to 4 experts with expert parallelism 2 (exact: same held-back loss)."""
    from pathlib import Path

    import yaml
    from mlflow import MlflowClient

    from cluster.prepare import prepare_new
    from tests.conftest import ROOT, in_workdir
    from tests.distributed import run_distributed, train_jobs

    base = [o for o in GROW if not o.startswith(("growth.schedule", "model.num_kv_heads"))] + ["train.max_steps=6"]
    enc = base + ["zero.stage=1", "growth.optimizer=grow", "growth.schedule=[{at_step: 2, depth: 2x}, {at_step: 4, width: 2x, noise: 0}]"]
    moe = base + ["zero.stage=2", "moe.ep_size=2",
                  "growth.schedule=[{at_step: 3, experts: 4, top_k: 2, noise: 0}]"]
    with in_workdir(tmp_path):
        e = prepare_new(load_config(ROOT / "configs" / "demo-encoder.yaml", enc))
        m = prepare_new(load_config(ROOT / "configs" / "demo-decoder.yaml", moe))
        finals = run_distributed(train_jobs, 2, [dataclasses.asdict(e), dataclasses.asdict(m)], timeout=900)[0]
        client = MlflowClient()

        def history(run_id, key):
            return {x.step: x.value for x in client.get_metric_history(run_id, key)}

        assert all(f["step"] == 6 for f in finals)
        b, a = history(e.run_id, "growth/loss_before"), history(e.run_id, "growth/loss_after")
        assert a[4] == pytest.approx(b[4], rel=1e-5), "tiled width growth of a post-norm encoder is exact"
        b, a = history(m.run_id, "growth/loss_before"), history(m.run_id, "growth/loss_after")
        assert a[3] == pytest.approx(b[3], rel=1e-5), "upcycling is exact"
        saved = yaml.safe_load((Path(m.run_dir) / "step_00000006" / "config.yaml").read_text())
        assert saved["moe"]["num_experts"] == 4 and saved["moe"]["ep_size"] == 2
        assert "moe/block0/max_share" in client.get_run(m.run_id).data.metrics
        enc_cfg = yaml.safe_load((Path(e.run_dir) / "step_00000006" / "config.yaml").read_text())["model"]
        assert (enc_cfg["num_layers"], enc_cfg["hidden_size"]) == (4, 64)


@pytest.mark.slow
def test_offline_grow_and_upcycle_child_runs_resume_export_and_show_lineage(tmp_path):
    """`grow` on a trained run: identity depth + tiled width without noise (the held-back loss is unchanged, logged),
    a child MLflow run tagged with its parent that `runs` shows, resumes (1 -> 2 workers) and exports with a passing
    parity check; `grow experts=4` upcycles and exports as Mixtral."""
    import json
    import subprocess

    from mlflow import MlflowClient

    from tests.conftest import PYTHON, ROOT, cli_env

    def cli(*args):
        proc = subprocess.run([PYTHON, "-m", "pretrain", *args], cwd=tmp_path, env=cli_env(tmp_path),
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{args}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        return proc.stdout

    base = [o for o in GROW if not o.startswith("growth.")] + ["train.max_steps=4", "cluster.num_workers=1",
                                                                "zero.stage=2"]
    out = cli("train", str(ROOT / "configs" / "demo-decoder.yaml"), *base)
    parent = next(line.split()[-1] for line in out.splitlines() if line.strip().startswith("MLflow run id"))
    out = cli("grow", parent, "depth=+2", "depth_op=identity", "width=2x", "noise=0")
    child = next(line.split()[3].rstrip(":") for line in out.splitlines() if line.startswith("[grow] new run"))
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    tags = client.get_run(child).data.tags
    assert tags["growth.parent_run_id"] == parent and tags["growth.parent_step"] == "4"
    assert tags["mlflow.parentRunId"] == parent and "depth 2->4 identity" in tags["growth.operator"]
    m = client.get_run(child).data.metrics
    assert m["growth/loss_after"] == pytest.approx(m["growth/loss_before"], rel=1e-5)
    assert f"growth of run {parent} at step 4" in cli("runs", child)
    assert f"^ growth of run {parent}" in cli("runs")
    cli("resume", child, "train.max_steps=6", "cluster.num_workers=2")
    hist = {x.step for x in client.get_metric_history(child, "train/loss")}
    assert hist == {5, 6}, "the grown run continues the parent's step count and data"
    report = cli("export", child, "--out", str(tmp_path / "hf_grown"))
    assert "LlamaForCausalLM" in report and "parity" in report
    cfg = json.loads((tmp_path / "hf_grown" / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["tie_word_embeddings"]) == (4, 64, False)
    out = cli("grow", parent, "experts=4", "noise=0")
    moe_child = next(line.split()[3].rstrip(":") for line in out.splitlines() if line.startswith("[grow] new run"))
    report = cli("export", moe_child, "--out", str(tmp_path / "hf_moe"))
    assert "MixtralForCausalLM" in report


def test_stability_restarts_at_a_growth():
    from pretrain.config import StabilityConfig
    from pretrain.train.stability import StabilityMonitor, StepSignals

    mon = StabilityMonitor(StabilityConfig(warmup_steps=0, good_after_steps=0))
    for s in range(1, 20):
        mon.decide(StepSignals(s, 5.0 - s * 0.01, 1.0))
    mon.note_checkpoint(19, "/ckpt/step_19", 19 * 8)
    assert mon.rollback_target() is not None and len(mon.s.grad_norms) == 19
    mon.restart()
    assert mon.rollback_target() is None and mon.s.grad_norms == [] and mon.s.losses == []
    assert mon.decide(StepSignals(20, 9.0, 40.0)).action == "ok", "a new scale is no spike before a new window"


def test_optimizer_grow_refused_with_expert_parallelism():
    from pretrain.config import ConfigError

    with pytest.raises(ConfigError, match="^growth.optimizer: grow"):
        load_config(None, ["moe.num_experts=4", "moe.ep_size=2", "cluster.num_workers=2", "data.num_streams=2",
                           "growth.optimizer=grow"])
