"""A first step in seconds, as commands: ``train --dry-run`` (the checks and the plan, nothing created), the imports
a fresh driver and an eager model pay for, and an embedded Ray that ends with its command."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import psutil

from pretrain.data.tokenizer_cache import run_tokenizer
from tests.conftest import PYTHON, ROOT, cli_env
from tests.harness import cli
from tests.integration.cli.test_bad_input import assert_refused
from tests.unit.data.common import make_docs, write_txt

CONFIG = str(ROOT / "configs" / "demo-decoder.yaml")


def dry_run(tmp_path: Path, *args: str, expect: int = 0) -> subprocess.CompletedProcess:
    return cli(
        tmp_path,
        "train",
        CONFIG,
        *args,
        "--dry-run",
        expect=expect,
        env={**cli_env(tmp_path, store=False), "PRETRAIN_CACHE": os.environ["PRETRAIN_CACHE"]},
    )


def test_dry_run_checks_prints_the_plan_and_creates_nothing(tmp_path, cache):
    corpus = write_txt(tmp_path / "c.txt", make_docs(1200, "doc"))
    args = (
        f"data.sources=[{{path: {corpus}}}]",
        "data.tokenizer_vocab_size=400",
        "data.tokenizer_train_docs=800",
        "train.max_steps=7",
        "checkpoint.dir=ck",
        "cluster.num_workers=2",
        "cluster.cpus_per_worker=0.5",
    )
    proc = dry_run(tmp_path, *args)
    out = proc.stdout
    assert "preflight passed" in out and "nothing was started or created" in out
    assert "4 layers x 256" in out and "vocab 448" in out and "M parameters" in out
    assert "2 worker(s), global batch 16 x 128 tokens = 2,048 tokens/step; 8 sequences/worker" in out
    assert "7 (14,336 tokens)" in out and "ZeRO-1" in out and f"{tmp_path / 'ck'}/RUN_ID" in out
    assert "trained at start on 800 documents" in out and "not cached yet" in out
    assert "through an embedded local Ray" in out  # two workers
    one = dry_run(tmp_path, *args[:-2])
    assert "in this process (one worker: nothing for Ray to do" in one.stdout
    assert not (tmp_path / "ck").exists() and not (tmp_path / "mlflow.db").exists() and not cache.exists()

    # once the tokenizer is cached, the plan says so (and counts the model with its real vocabulary)
    from pretrain.config import load_config
    from pretrain.config.paths import resolve_paths
    from pretrain.driver.prepare import preflight

    cfg = resolve_paths(load_config(CONFIG, list(args)), tmp_path)
    preflight(cfg)
    run_tokenizer(cfg.data, tmp_path / "tok", lambda _: None)
    proc = dry_run(tmp_path, *args)
    assert "reused from cache" in proc.stdout and "(400 tokens)" in proc.stdout

    # checks fail as a run's would: one line, exit 2
    assert_refused(dry_run(tmp_path, "model.bogus=1", expect=2), "model.bogus")
    assert_refused(dry_run(tmp_path, "checkpoint.dir=/proc/pretrain-x", expect=2), "checkpoint.dir")
    missing = f"data.sources=[{{path: {tmp_path / 'missing.txt'}}}]"
    assert_refused(dry_run(tmp_path, *args, missing, expect=2), "missing.txt")
    assert not (tmp_path / "ck").exists() and not (tmp_path / "mlflow.db").exists()


def test_the_driver_imports_no_training_stack():
    """Preparing a run and handing it to Ray needs neither DeepSpeed nor transformers in the driver (the
    workers import them); a cached tokenizer is only copied. The checks that refuse bad input (config, paths,
    corpora: ``pretrain.driver.prepare``) import not even torch, so a refusal comes at once."""
    code = (
        "import sys; import pretrain.driver.prepare; before = 'torch' in sys.modules; "
        "import cluster.launch, pretrain.data.tokenizer_cache, pretrain.driver.dry_run; "
        "print(json.dumps([before] + sorted(m for m in ('deepspeed', 'transformers', 'datasets', "
        "'pretrain.train.worker') if m in sys.modules)))"
    )
    proc = subprocess.run(
        [PYTHON, "-c", "import json; " + code],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [False]


def test_an_eager_model_never_imports_dynamo():
    """Importing ``torch._dynamo`` costs every worker's start seconds: the training loop's imports and an eager MoE
    model's forward and backward do without it (only compiling blocks marks the experts eager for dynamo)."""
    code = (
        "import sys, torch; import pretrain.train.worker; from pretrain.config import load_config; "
        "from pretrain.model import build_model; "
        "cfg = load_config(None, ['moe.num_experts=4', 'moe.top_k=2', 'model.hidden_size=32', "
        "'model.num_heads=2', 'model.num_kv_heads=1', 'model.num_layers=2', 'model.vocab_size=64']); "
        "m = build_model(cfg.model, 0, cfg.moe); ids = torch.randint(0, 64, (2, 8)); "
        "m(ids, labels=ids).objective().backward(); print('torch._dynamo' in sys.modules)"
    )
    proc = subprocess.run(
        [PYTHON, "-c", code],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "False"


def test_an_embedded_ray_ends_with_the_command():
    """After a finished run the CLI disconnects its Ray driver and leaves the embedded Ray it started to end with
    its process (no graceful shutdown's waits): every process of that Ray — the raylet's agents and workers too,
    which fate sharing does not reach — is gone within seconds of the command's exit. Its workers run at this
    process's niceness, not at Ray's default of 15 for workers, under which any other busy process of the terminal
    session (pytest's other worker, here) would take nearly all the CPU from a run's Train workers."""
    code = (
        "import os, psutil, ray; from cluster.launch import ensure_ray; "
        "from cluster.ray_process import end_ray_with_process; "
        "from pretrain.config import ClusterConfig; started = ensure_ray(ClusterConfig()); "
        "niceness = ray.get(ray.remote(lambda: os.nice(0)).remote()); "
        "pids = [p.pid for p in psutil.Process().children(recursive=True)]; "
        "print(started, niceness - os.nice(0), *pids, flush=True); end_ray_with_process(started); "
        "print(ray.is_initialized()); "
        "from pretrain.__main__ import exit_without_teardown; exit_without_teardown(0)"
    )
    proc = subprocess.run(
        [PYTHON, "-c", code],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    started, niceness, *pids, connected = proc.stdout.split()
    assert started == "True" and len(pids) >= 5  # at least GCS, raylet, its two agents and a worker
    assert niceness == "0", f"a Ray worker runs {niceness} nicer than its driver"
    assert connected == "False", "the driver is disconnected before its servers are killed"
    alive = [int(p) for p in pids]
    deadline = time.monotonic() + 15  # from the command's exit: starting Ray on a loaded machine takes long
    while True:
        alive = [p for p in alive if _running(p)]
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert alive == []


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie waiting for its reaper is not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
