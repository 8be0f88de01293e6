"""Command line: ``python -m pretrain CMD ...`` (``./launch.sh CMD ...`` sets up .venv first).

    train [CONFIG.yaml] [key.sub=value ...] [--dry-run]   train (default config: configs/demo-decoder.yaml);
                                                  key.sub=value: any config key, e.g. train.max_steps=100 or
                                                  data.sources[0].text_field=content (docs/configuration.md);
                                                  --dry-run: check everything a run checks first and print its
                                                  plan (model, tokenizer, batch, steps, workers...), start nothing
    resume RUN_ID|CHECKPOINT_DIR [key=value ...]  continue from the latest committed checkpoint
    runs [RUN_ID [--plot]]                        tracked runs, or one run's checkpoints (--plot: PNG)
    ui [--port N] [--host H] [--open] [--workers N]   the MLflow UI on the tracking store (127.0.0.1); prints each
                                                  experiment's link (opens as model training), --open: in a browser
    bench [--json] [--no-moe] [--layer-drop] [CONFIG] [key=value ...]   our step vs bare PyTorch, MoE vs dense,
                                                  all-to-all, data, the real training loop (loop_vs_step_ratio,
                                                  time_to_first_step_s; --no-loop skips it); --layer-drop: tokens/s
                                                  at rates 0, 0.25, 0.5
    bench --vs-hf [--repeats N] [--corpus PATH] [--json]   ./launch.sh train against Hugging Face Trainer
    bench --growth [--seeds 0,1] [--tokens N] [--recipes A,B] [--scan] [--gpu-size] [--json]   the growth study:
                                                  scratch vs growth recipes vs their small models alone at
                                                  equal FLOPs, per seed (--scan: only scratch and the small models)
    bench --layer-drop --quality [--seeds 0,1] [--tokens N] [--json]   the layer-dropout study: progressive
                                                  layer dropping's time to loss, pruned vs half depth from scratch
    bench --build-corpus [--out DIR] [--json]     the studies' corpus: the installed packages' Python sources and
                                                  docs, deduplicated, split by hash, token-counted, cached
    bench --data [--json] [--tiny] [--mb N]       token shards: tokenize throughput with 1 and 2 Ray workers, the
                                                  loader's tokens/s from shards against from text
    bench --recompute [CONFIG]                    activation recomputation: peak memory and step time
    bench --parallel [--seq-len N] [--json]       sequence/tensor parallelism: tokens/s, memory, communication
    bench --cluster [--json]                      submit-to-first-step latency, checkpoint time share
    bench --checkpoint [--json] [--sizes 256,512,1024]   checkpoint bytes, loop stall per save (sync/async), save
                                                  vs raw write, per-rank hash seconds, resume to first step
    bench --gpu [--json] [--tiny] [--only ITEMS] [--results DIR]   the one GPU check: bf16 training, MFU, SDPA kernel,
                                                  memory plan, async checkpoint + resume, ZeRO-3, MoE, growth, export
                                                  (tiny on CPU)
    bench --early-exit --model RUN_ID|CHECKPOINT|HF_DIR [--exits 1,2] [--prompts 50] [--json]   self-speculative
                                                  against plain greedy decoding on held-out prompts: tokens/s per
                                                  exit, identical outputs, acceptance, also via generate
    tokenize SOURCE... --out DIR [--tokenizer RUN_ID|PATH] [--shard-tokens N] [--workers N]   tokenize a corpus
                                                  once into memory-mapped token shards (a Ray Data job; RAY_ADDRESS
                                                  for a cluster); train on them with data.sources=[{path: DIR}]
    export RUN_ID|CHECKPOINT --out DIR [--step N] [--register NAME] [--device D]   verified Hugging Face export
    verify RUN_ID|CHECKPOINT                      check every file's size and checksum (exit 2 naming the first
                                                  bad file); a run: its latest committed checkpoint
    eval RUN_ID|CHECKPOINT|HF_DIR [--data PATH ...] [--json]          loss, ppl, bits/byte, MLM accuracy
    generate RUN_ID|CHECKPOINT|HF_DIR --prompt TEXT [--max-new-tokens N] [--early-exit E] [--temperature T] [--json]
                                                  sample from a decoder (greedy by default): the text and tokens/s;
                                                  --early-exit E: also self-speculative decoding (the first E layers
                                                  draft, all verify), its tokens/s, whether it equals plain greedy,
                                                  and its acceptance rate
    prune RUN_ID|CHECKPOINT layers=every_other|first:N|[i,j,..] [step=N] [scale=inference|train]   keep some
                                                  blocks: a new child run
    grow RUN_ID|CHECKPOINT [depth=2x|+N|N] [depth_op=stack|interleave|identity] [width=..] [width_op=tile|net2net]
         [heads=..] [ffn=..] [experts=E] [top_k=K] [noise=X] [rewarm=N] [step=N]   grow the model: a new child run
    anneal RUN_ID|CHECKPOINT steps=N [step=S] [key=value ...]   decay the LR of a (WSD) checkpoint to the floor
                                                  over N steps, optionally on other data: a new child run
    cluster up|down|status                        a local Ray head on 127.0.0.1 (token auth) to submit to
    submit [--address URL] [CONFIG] [key=value ...]  submit a training job (Ray Jobs API); prints job + run id
    jobs [--address URL]                          jobs on the cluster
    status JOB [--address URL]                    the job's status word (PENDING, RUNNING, SUCCEEDED, ...)
    logs JOB [--follow] [--address URL]           the job's output
    stop JOB [--address URL]                      stop a job (waits until it is STOPPED)

CMD --help (or -h): that command's usage and options. User errors (config, data, checkpoints) print one line and
exit 2, wherever they were detected; internal errors print their traceback and exit 1. Training runs keep their full
output in RUN_DIR/logs/driver.log.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import traceback
from pathlib import Path

from pretrain import timeline
from pretrain.config import DEFAULT_CONFIG, ConfigError, load_config, split_args
from pretrain.config.errors import ArgumentParser, quote, user_error, without_passwords
from pretrain.usage import asks_help, command_usage, print_help, reader_gone, stdout_closed


def cmd_train(args: list[str]) -> int:
    dry = "--dry-run" in args
    path, overrides = split_args([a for a in args if a != "--dry-run"])
    cfg = load_config(path or DEFAULT_CONFIG, overrides)  # validate before any heavy import
    from pretrain.train.schedule import schedule_warning

    if not cfg.train.max_flops and schedule_warning(cfg.train):  # (a budget's steps are known when the run is made)
        print(f"[pretrain] {schedule_warning(cfg.train)}", flush=True)
    if dry:  # the checks and the plan; nothing started or created
        from pretrain.driver.dry_run import dry_run

        return dry_run(cfg, path or str(DEFAULT_CONFIG))
    timeline.start()

    from pretrain.config.paths import resolve_paths
    from pretrain.driver.prepare import preflight, prepare_new
    from pretrain.driver.resume import check_resume_from, prepare_fork

    timeline.enter("run_preparation")
    cfg = resolve_paths(cfg)
    preflight(cfg)  # a bad corpus or directory is refused before Ray starts (and before the imports below)
    fork = check_resume_from(cfg)  # checkpoint.resume_from: the checks of `resume DIR`, also before Ray starts
    from cluster.launch import prepare_while_ray_starts
    from pretrain.driver.launched import launched

    # The run is created (MLflow, tokenizer) while Ray starts.
    from pretrain.driver.run_job import abandon, run_job

    launch = launched()  # (the other ranks of a launch follow rank 0's job, whatever it is)
    if launch is not None and launch.leads and (restarted := launch.earlier_run()) is not None:
        from pretrain.driver.resume import prepare_resume

        # torchrun --max-restarts: the run of the launch's first attempt, from its latest checkpoint
        print(f"[pretrain] a restart of this torchrun launch: resuming its run {restarted}", flush=True)
        return run_job(
            lambda held: (prepare_resume(restarted, [], hold=held), False),
            lambda job: f"resuming run {job.run_id} into {job.run_dir} (torchrun restarted the launch)",
        )

    def prepare(held):
        return prepare_new(cfg, checked=True, hold=held) if fork is None else prepare_fork(cfg, fork, held)

    return run_job(
        lambda held: prepare_while_ray_starts(cfg.cluster, lambda: prepare(held), abandon),
        lambda job: f"run {job.run_id}: {cfg.name}, {cfg.model.kind}, checkpoints in {job.run_dir}",
    )


def cmd_resume(args: list[str]) -> int:
    timeline.start()
    from pretrain.driver.resume import prepare_resume

    if not args:
        raise ConfigError("resume: give a run id or a checkpoint directory")
    timeline.enter("run_preparation")
    from pretrain.driver.run_job import run_job

    return run_job(
        lambda held: (prepare_resume(args[0], args[1:], hold=held), False),
        lambda job: f"resuming run {job.run_id} into {job.run_dir}",
    )


def cmd_runs(args: list[str]) -> int:
    from pretrain.driver.runs import runs

    return runs(args)


def cmd_ui(args: list[str]) -> int:
    from pretrain.driver import ui_links
    from pretrain.train.tracking import mark_training_experiments, shown_uri, tracking_uri

    p = ArgumentParser(prog="launch.sh ui")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: local only)")
    p.add_argument("--port", default="5000")
    p.add_argument(
        "--workers", default="1", help="server processes (default 1; several can miss uvicorn's 5 s health check)"
    )
    p.add_argument("--open", action="store_true", help="open the experiment in a browser once the UI is up")
    a = p.parse_args(args)
    for flag, value in (("--port", a.port), ("--workers", a.workers)):
        if not (value.isascii() and value.isdigit()) or int(value) < 1:
            raise ConfigError(f"ui {flag}: a positive whole number, got {value!r}")
    if int(a.port) > 65535:
        raise ConfigError(f"ui --port: a TCP port is at most 65535, got {a.port}")
    uri = tracking_uri()
    if uri.startswith(("http://", "https://")):
        raise ConfigError(
            f"ui: the tracking store is an MLflow server ({shown_uri(uri)}), which serves its own UI: open "
            f"{ui_links.ui_base(uri)}"
        )
    from pretrain.ports import port_problem

    problem = port_problem(int(a.port), a.host)
    if problem == "is in use":
        raise ConfigError(f"ui --port {a.port}: {a.host}:{a.port} is in use (another server?); pass another --port")
    if problem:
        raise ConfigError(f"ui --host {a.host}: {a.host}:{a.port} {problem}")
    mark_training_experiments(uri)  # experiments made before the kind tag open as training, not GenAI
    mlflow = Path(sys.executable).with_name("mlflow")
    print(f"[pretrain] MLflow UI for {shown_uri(uri)} on http://{a.host}:{a.port}", flush=True)
    base = ui_links.served_base(a.host, a.port)
    links = [
        (f"experiment {name}", ui_links.ui_url(base, exp_id)) for exp_id, name in ui_links.training_experiments(uri)
    ]
    for what, url in links or [("experiments", ui_links.ui_url(base))]:
        print(f"[pretrain] {what}: {url}", flush=True)
    if a.open:
        ui_links.open_when_serving(links[0][1] if links else ui_links.ui_url(base), a.host, int(a.port))
    command = ["ui", "--host", a.host, "--port", a.port, "--workers", a.workers]
    # The store reaches MLflow through its environment variable, not the command line: any local user can read a
    # process's arguments (ps, /proc/PID/cmdline), and the URI may hold a password.
    os.environ["MLFLOW_BACKEND_STORE_URI"] = uri
    # MLflow's job runner serves GenAI jobs (judges, prompt optimization, trace roll-ups), which a training store
    # has none of: a runner and seven consumer processes, each importing MLflow, several times the UI's own CPU at
    # start and memory, beside training on the same machine (benchmarks/ui_cpu.py).
    # MLFLOW_SERVER_ENABLE_JOB_EXECUTION=true brings them back.
    os.environ.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
    os.execv(str(mlflow), [str(mlflow), *command])


def cmd_bench(args: list[str]) -> int:
    from benchmarks.cli import bench

    return bench(args)


def cmd_tokenize(args: list[str]) -> int:
    from pretrain.driver.tokenize import tokenize

    return tokenize(args)


def cmd_export(args: list[str]) -> int:
    from transformers.utils import logging as hf_logging

    from pretrain.export.hf import main as export_main

    hf_logging.disable_progress_bar()
    return export_main(args)


def cmd_verify(args: list[str]) -> int:
    """Full check of a checkpoint: every file's size and sha256 against its manifest (a resume hashes only what
    each rank loads; this reads everything). A run id or run directory checks its latest committed checkpoint."""
    from pretrain.checkpoint import latest_committed, open_committed, store
    from pretrain.train import tracking

    if len(args) != 1:
        raise ConfigError("verify: give one run id or checkpoint directory")
    path = Path(args[0]).expanduser()
    if not path.exists():
        if tracking.names_a_path(args[0]):
            raise ConfigError(f"verify: {args[0]}: no such checkpoint or run directory")
        path = tracking.run_checkpoint_root(tracking.tracking_uri(), args[0])
    ckpt = open_committed(path) if store.is_checkpoint_dir(path) else latest_committed(path)
    if ckpt is None:
        raise ConfigError(f"verify: no committed checkpoint in {path}")
    store.verify_or_point_back(ckpt)
    m = ckpt.manifest
    print(f"verify: OK {ckpt.path} (step {m.step}, {len(m.files)} files, {m.total_bytes / 1e6:.1f} MB)")
    return 0


def cmd_eval(args: list[str]) -> int:
    from transformers.utils import logging as hf_logging

    from eval.evaluate import main as eval_main

    hf_logging.disable_progress_bar()
    return eval_main(args)


def cmd_generate(args: list[str]) -> int:
    from transformers.utils import logging as hf_logging

    from eval.generate import main as generate_main

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()  # transformers' drafting loop warns about its own internal generate call
    return generate_main(args)


def cmd_grow(args: list[str]) -> int:
    from pretrain.driver.grow import grow

    return grow(args)


def cmd_prune(args: list[str]) -> int:
    from pretrain.driver.prune import prune

    return prune(args)


def cmd_anneal(args: list[str]) -> int:
    from pretrain.driver.anneal import anneal

    return anneal(args)


def cmd_cluster(args: list[str]) -> int:
    from functools import partial

    from cluster import head, jobs

    return head.run_cli(partial(head.main, stop_jobs=jobs.stop_running), args, "cluster")


def cmd_submit(args: list[str]) -> int:
    from cluster import head, submit

    return head.run_cli(submit.submit, args, "submit")


def cmd_jobs(args: list[str]) -> int:
    from cluster import head, jobs

    return head.run_cli(jobs.jobs, args, "jobs")


def cmd_status(args: list[str]) -> int:
    from cluster import head, jobs

    return head.run_cli(jobs.status, args, "status")


def cmd_logs(args: list[str]) -> int:
    from cluster import head, jobs

    return head.run_cli(jobs.logs, args, "logs")


def cmd_stop(args: list[str]) -> int:
    from cluster import head, jobs

    return head.run_cli(jobs.stop, args, "stop")


COMMANDS = {
    "train": cmd_train,
    "resume": cmd_resume,
    "runs": cmd_runs,
    "ui": cmd_ui,
    "bench": cmd_bench,
    "tokenize": cmd_tokenize,
    "export": cmd_export,
    "verify": cmd_verify,
    "eval": cmd_eval,
    "generate": cmd_generate,
    "prune": cmd_prune,
    "grow": cmd_grow,
    "anneal": cmd_anneal,
    "cluster": cmd_cluster,
    "submit": cmd_submit,
    "jobs": cmd_jobs,
    "status": cmd_status,
    "logs": cmd_logs,
    "stop": cmd_stop,
}
# Commands whose argparse answers --help with its options; the others answer with their lines of the table above.
_ARGPARSE_COMMANDS = {
    "ui",
    "bench",
    "tokenize",
    "export",
    "eval",
    "generate",
    "cluster",
    "submit",
    "jobs",
    "status",
    "logs",
    "stop",
}


def _root_cause(exc: BaseException) -> str:
    """The last "XyzError: ..." line of an internal error (Ray wraps worker failures in several layers)."""
    text = str(exc).strip().splitlines()
    for line in reversed(text):
        m = re.match(r"^\s*(?:[\w.]+\.)?(\w+(?:Error|Exception|Interrupt)): (.+)$", line)
        if m and m.group(1) not in ("RaySystemError", "ControllerError", "TrainingFailedError"):
            return f"{m.group(1)}: {m.group(2)}"
    return f"{type(exc).__name__}: {text[0] if text else ''}"


CUDA_ALLOC_CONF = "expandable_segments:True"
"""``PYTORCH_CUDA_ALLOC_CONF`` unless the user set it: the caching allocator grows segments in place instead of
keeping blocks of each size apart, so allocations that vary in size from step to step (activations of packed
sequences, MoE token counts, ZeRO-3 gathers) fragment less and runs near the memory plan's total do not run out."""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        return print_help(__doc__ or "")
    cmd, rest = argv[0], argv[1:]
    if not any(Path(dev).exists() for dev in ("/dev/nvidiactl", "/dev/kfd")):  # no GPU driver: DeepSpeed would
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # warn about falling back to CPU (workers inherit this)
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")  # not "Creating initial MLflow database tables..."
    # Before any CUDA allocation; workers get it too (cluster/launch.py forwards it).
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", CUDA_ALLOC_CONF)
    if cmd not in COMMANDS:
        print(f"error: unknown command {quote(cmd)} (commands: {', '.join(COMMANDS)})", file=sys.stderr)
        return 2
    if cmd not in _ARGPARSE_COMMANDS and asks_help(rest):
        return print_help(command_usage(__doc__ or "", cmd))
    try:
        return COMMANDS[cmd](rest)
    except SystemExit as e:  # argparse: --help (0) or a usage error (2), printed already
        return e.code if isinstance(e.code, int) else 1
    except KeyboardInterrupt as e:
        signum = getattr(e, "signum", signal.SIGINT)
        print(f"error: {e}" if str(e) else "interrupted", file=sys.stderr)
        return 128 + signum
    except Exception as e:  # noqa: BLE001 - user errors become one line; internal ones keep their traceback
        if isinstance(e, BrokenPipeError) and stdout_closed():  # `runs | head`: end quietly, as `ls | head` does
            return reader_gone()
        if os.environ.get("PRETRAIN_DEBUG"):
            raise
        known = user_error(e)
        if known is not None:
            print(f"error: {without_passwords(known[1])}", file=sys.stderr)
            return known[0]
        # with its notes (the full log of a training run); a URL's password (a tracking server's) never printed
        print(without_passwords("".join(traceback.format_exception(e))), end="", file=sys.stderr)
        print(f"error: internal error: {without_passwords(_root_cause(e))}", file=sys.stderr)
        return 1
