"""Command line: ``python -m pretrain CMD ...`` (``./launch.sh CMD ...`` sets up .venv first).

    train [CONFIG.yaml] [key.sub=value ...] [--dry-run]   train (default config: configs/demo-decoder.yaml);
                                                  --dry-run: check everything a run checks first and print its
                                                  plan (model, tokenizer, batch, steps, workers...), start nothing
    resume RUN_ID|CHECKPOINT_DIR [key=value ...] continue from the latest committed checkpoint
    runs [RUN_ID [--plot]]                        tracked runs, or one run's checkpoints (--plot: PNG)
    ui [--port N] [--host H]                      the MLflow UI on the tracking store (127.0.0.1)
    bench [--json] [--no-moe] [--layer-drop] [CONFIG] [key=value ...]   our step vs bare PyTorch, MoE vs dense,
                                                  all-to-all, data, the real training loop (loop_vs_step_ratio,
                                                  time_to_first_step_s; --no-loop skips it); --layer-drop: tokens/s
                                                  at rates 0, 0.25, 0.5
    bench --cluster [--json]                      submit-to-first-step latency, checkpoint time share
    bench --checkpoint [--json] [--sizes 256,512,1024]   checkpoint bytes, loop stall per save (sync/async), save
                                                  vs raw write, per-rank hash seconds, resume to first step
    export RUN_ID|CHECKPOINT --out DIR [--step N] [--register NAME]   verified Hugging Face export
    verify RUN_ID|CHECKPOINT                      check every file's size and checksum (exit 2 naming the first
                                                  bad file); a run: its latest committed checkpoint
    eval RUN_ID|CHECKPOINT|HF_DIR [--data PATH ...] [--json]          loss, ppl, bits/byte, MLM accuracy
    prune RUN_ID|CHECKPOINT layers=every_other|first:N|[i,j,..] [step=N]   keep some blocks: a new child run
    grow RUN_ID|CHECKPOINT [depth=2x|+N|N] [depth_op=stack|interleave|identity] [width=..] [width_op=tile|net2net]
         [heads=..] [ffn=..] [experts=E] [top_k=K] [noise=X] [step=N]       grow the model: a new child run
    anneal RUN_ID|CHECKPOINT steps=N [step=S] [key=value ...]   decay the LR of a (WSD) checkpoint to the floor
                                                  over N steps, optionally on other data: a new child run
    cluster up|down|status                        a local Ray head on 127.0.0.1 (token auth) to submit to
    submit [--address URL] [CONFIG] [key=value ...]  submit a training job (Ray Jobs API); prints job + run id
    jobs [--address URL]                          jobs on the cluster
    status JOB [--address URL]                    the job's status word (PENDING, RUNNING, SUCCEEDED, ...)
    logs JOB [--follow] [--address URL]           the job's output
    stop JOB [--address URL]                      stop a job (waits until it is STOPPED)

User errors (config, data, checkpoints) print one line and exit 2, wherever they were detected; internal
errors print their traceback and exit 1. Training runs keep their full output in RUN_DIR/logs/driver.log.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
import traceback
from pathlib import Path

from pretrain import timeline
from pretrain.config import DEFAULT_CONFIG, ConfigError, load_config, split_args


def _print_summary(final: dict, job, uri: str) -> None:
    cfg_name = job.config["name"]
    run_id = job.run_id
    rows = [("final train loss", f"{final.get('final_train_loss', float('nan')):.4f}")]
    if "val_loss" in final:
        rows.append(("final val loss", f"{final['val_loss']:.4f}  (ppl {final.get('val_ppl', float('nan')):.1f})"))
    if "val_mlm_acc" in final:
        rows.append(("val MLM accuracy", f"{final['val_mlm_acc']:.4f}"))
    if "unigram_val_loss" in final:
        rows.append(
            ("unigram baseline", f"{final['unigram_val_loss']:.4f}  (val loss of a unigram model on the same data)")
        )
    rows += [
        (
            "tokens/s",
            f"{final.get('tokens_per_s', 0):,.0f}  ({final.get('tokens_seen', 0):,} tokens, "
            f"{final.get('step', 0)} steps)",
        ),
        ("checkpoint", final.get("checkpoint", "")),
        ("MLflow run id", run_id),
    ]
    if final.get("bad_records"):
        rows.append(("bad records", f"{final['bad_records']} skipped (see data/bad_records.json in the run)"))
    print(f"\n== finished: {cfg_name} ==")
    for k, v in rows:
        print(f"  {k:<18} {v}")
    env = "" if "MLFLOW_TRACKING_URI" not in os.environ else f"MLFLOW_TRACKING_URI={shlex.quote(uri)} "
    print("\n  resume:      " + f"{env}./launch.sh resume {run_id} train.max_steps={final.get('step', 0) * 2}")
    print("  export:      " + f"{env}./launch.sh export {run_id} --out exported/{run_id}")
    print(
        "  MLflow UI:   " + f"{env}./launch.sh ui   (or: .venv/bin/mlflow ui --backend-store-uri "
        f"{shlex.quote(uri)} --host 127.0.0.1 --port 5000)"
    )


def cmd_train(args: list[str]) -> int:
    dry = "--dry-run" in args
    path, overrides = split_args([a for a in args if a != "--dry-run"])
    cfg = load_config(path or DEFAULT_CONFIG, overrides)  # validate before any heavy import
    if dry:  # the checks and the plan; nothing started or created
        from pretrain.driver.dry_run import dry_run

        return dry_run(cfg, path or str(DEFAULT_CONFIG))
    timeline.start()

    from pretrain.config.paths import resolve_paths
    from pretrain.driver.prepare import preflight, prepare_new

    timeline.enter("run_preparation")
    cfg = resolve_paths(cfg)
    preflight(cfg)  # a bad corpus or directory is refused before Ray starts (and before the imports below)
    from cluster.launch import prepare_while_ray_starts

    # The run is created (MLflow, tokenizer) while Ray starts.
    return _run_job(
        lambda: prepare_while_ray_starts(cfg.cluster, lambda: prepare_new(cfg, checked=True)),
        lambda job: f"run {job.run_id}: {cfg.name}, {cfg.model.kind}, checkpoints in {job.run_dir}",
    )


def cmd_resume(args: list[str]) -> int:
    timeline.start()
    from pretrain.driver.prepare import prepare_resume

    if not args:
        raise ConfigError("resume: give a run id or a checkpoint directory")
    timeline.enter("run_preparation")
    return _run_job(
        lambda: (prepare_resume(args[0], args[1:]), False), lambda job: f"resuming run {job.run_id} into {job.run_dir}"
    )


def _run_job(prepare, announce) -> int:
    """``prepare()`` the job (returns it and whether it started Ray, which is then shut down at the end) and run
    it, the terminal quiet from the start (:class:`QuietConsole`: the log goes into the run directory once the
    run exists). ``announce(job)``: the line that names the run."""
    from cluster.launch import end_ray_with_process, run, stop_ray
    from pretrain.config import from_dict
    from pretrain.driver.console import QuietConsole
    from pretrain.train.tracking import Tracker, tracking_uri

    with QuietConsole(None) as console:
        job, ray_started = prepare()
        log = Path(job.run_dir) / "logs" / "driver.log"
        console.set_log(log)
        print(f"[pretrain] {announce(job)}", flush=True)
        print(f"[pretrain] full log (Ray, DeepSpeed, every worker): {log}", flush=True)
        tracker = Tracker(job.tracking_uri, job.run_id)
        try:
            try:
                final = run(job, from_dict(job.config).cluster)
            except BaseException:
                stop_ray(ray_started)
                raise
            end_ray_with_process(ray_started)  # the command ends right after the summary
        except BaseException as e:
            tracker.finish("FAILED" if not isinstance(e, KeyboardInterrupt) else "KILLED")
            e.add_note(f"full log: {log}")
            raise
        tracker.finish("FINISHED")
    _print_summary(final, job, tracking_uri())
    return 0


def cmd_runs(args: list[str]) -> int:
    from pretrain.checkpoint import list_committed
    from pretrain.train import tracking

    uri = tracking.tracking_uri()
    plot = "--plot" in args
    args = [a for a in args if a != "--plot"]
    if plot and not args:
        raise ConfigError("runs --plot: give a run id (runs RUN_ID --plot)")
    if args:
        run = tracking.find_run(uri, args[0])
        if run is None:
            raise ConfigError(f"{args[0]}: no such run in {uri}")
        root = run.data.tags.get(tracking.TAG_CKPT_ROOT, "")
        print(f"run {args[0]} ({run.info.run_name}, {run.info.status}); checkpoints in {root}")
        for line in _lineage(run.data.tags):
            print(f"  {line}")
        if run.data.tags.get("pretrain.stability.last_event"):
            print(
                f"  stability: {run.data.tags.get('pretrain.stability.events', '?')} event(s), last "
                f"{run.data.tags['pretrain.stability.last_event']}"
            )
        print(f"  {'step':>8} {'tokens':>12} {'train loss':>10} {'val loss':>9}  path")
        for c in list_committed(Path(root)) if root else []:
            m = c.manifest.metrics
            print(
                f"  {c.step:>8} {c.manifest.tokens_seen:>12,} {m.get('train/loss', float('nan')):>10.4f} "
                f"{m.get('val/loss', float('nan')):>9.4f}  {c.path}"
            )
        if plot:
            from pretrain.train.plot import plot_run

            out = Path(root) / "training.png" if root and Path(root).is_dir() else Path(f"{args[0]}.png")
            print(f"plot: {plot_run(uri, args[0], out).resolve()}")
        return 0
    runs = tracking.list_runs(uri)
    if not runs:
        print(f"no runs in {uri}")
        return 0
    print(f"tracking store: {uri}")
    print(f"{'run id':<34} {'name':<16} {'status':<9} {'step':>6} {'tokens':>11} {'val loss':>8}  latest checkpoint")
    for r in runs:
        m, tags = r.data.metrics, r.data.tags
        step = tags.get(tracking.TAG_CKPT_STEP, "-")
        print(
            f"{r.info.run_id:<34} {(r.info.run_name or '')[:16]:<16} {r.info.status:<9} {step:>6} "
            f"{int(m.get('train/tokens_seen', 0)):>11,} {m.get('val/loss', float('nan')):>8.4f}  "
            f"{tags.get(tracking.TAG_CKPT_LATEST, '-')}"
        )
        for line in _lineage(tags)[:1]:
            print(f"{'':<34} ^ {line}")
    return 0


def _lineage(tags: dict[str, str]) -> list[str]:
    """Where a run came from (a derived run's parent) and the growths it went through."""
    out = []
    derived = tags.get("pretrain.derived")
    if derived:
        parent = tags.get("mlflow.parentRunId") or tags.get("pretrain.parent_checkpoint", "?")
        step = tags.get("growth.parent_step") or tags.get("prune.parent_step") or tags.get("anneal.parent_step", "?")
        what = tags.get("growth.operator") or (
            f"LR decay to the floor over {tags['anneal.steps']} steps ({tags.get('anneal.shape', '?')})"
            if "anneal.steps" in tags
            else f"kept blocks {tags.get('prune.layers', '?')}"
        )
        out.append(f"{derived} of run {parent} at step {step}: {what}")
    grown = sorted(
        (int(k.split(".")[1]), v)
        for k, v in tags.items()
        if k.startswith("growth.") and k.endswith(".operator") and k.split(".")[1].isdigit()
    )
    for i, op in grown:
        out.append(f"growth at step {tags.get(f'growth.{i}.at_step', '?')}: {op}")
    return out


def cmd_ui(args: list[str]) -> int:
    from pretrain.train.tracking import tracking_uri

    p = argparse.ArgumentParser(prog="launch.sh ui")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: local only)")
    p.add_argument("--port", default="5000")
    a = p.parse_args(args)
    uri = tracking_uri()
    mlflow = Path(sys.executable).with_name("mlflow")
    print(f"[pretrain] MLflow UI for {uri} on http://{a.host}:{a.port}", flush=True)
    os.execv(str(mlflow), [str(mlflow), "ui", "--backend-store-uri", uri, "--host", a.host, "--port", a.port])


def cmd_bench(args: list[str]) -> int:
    from benchmarks.cli import bench

    return bench(args)


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
    path = Path(args[0])
    if not path.exists():
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


def cmd_grow(args: list[str]) -> int:
    from pretrain.driver.derive import grow

    return grow(args)


def cmd_prune(args: list[str]) -> int:
    from pretrain.driver.derive import prune

    return prune(args)


def cmd_anneal(args: list[str]) -> int:
    from pretrain.driver.anneal import anneal

    return anneal(args)


def cmd_cluster(args: list[str]) -> int:
    from cluster import head

    return head.run_cli(head.main, args)


def cmd_submit(args: list[str]) -> int:
    from cluster import head, submit

    return head.run_cli(submit.submit, args)


def cmd_jobs(args: list[str]) -> int:
    from cluster import head, jobs

    return head.run_cli(jobs.jobs, args)


def cmd_status(args: list[str]) -> int:
    from cluster import head, jobs

    return head.run_cli(jobs.status, args)


def cmd_logs(args: list[str]) -> int:
    from cluster import head, jobs

    return head.run_cli(jobs.logs, args)


def cmd_stop(args: list[str]) -> int:
    from cluster import head, jobs

    return head.run_cli(jobs.stop, args)


COMMANDS = {
    "train": cmd_train,
    "resume": cmd_resume,
    "runs": cmd_runs,
    "ui": cmd_ui,
    "bench": cmd_bench,
    "export": cmd_export,
    "verify": cmd_verify,
    "eval": cmd_eval,
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


# Errors a user acts on, by class name (a worker's error may reach us only as text): the config, data or a
# checkpoint is wrong (exit 2), or the run ended by a rule the user set (exit 1); either is one line, no traceback.
_EXIT_CODES = {
    "NonFiniteWeightsError": 1,
    "StabilityHaltError": 1,
    "ExportError": 1,
    "GrowthCheckError": 1,
    "ConfigError": 2,
    "BadRecordError": 2,
    "CheckpointError": 2,
}


def user_error(exc: BaseException) -> tuple[int, str] | None:
    """(exit code, one line) of an error the user acts on (see ``_EXIT_CODES``), wherever it was raised: here,
    or in a Ray worker, whose failure reaches us wrapped in Ray's errors (as objects, or only as text). None
    for an internal error."""
    seen = set()
    stack = [exc]
    while stack:
        e = stack.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        for cls in type(e).__mro__:  # the most specific known class decides
            if cls.__name__ in _EXIT_CODES:
                return _EXIT_CODES[cls.__name__], (str(e).strip().splitlines() or [cls.__name__])[0]
        for attr in ("worker_failures", "_worker_failures"):
            failures = getattr(e, attr, None)
            if isinstance(failures, dict):
                stack.extend(v for v in failures.values() if isinstance(v, BaseException))
        stack.extend(x for x in (e.__cause__, e.__context__, getattr(e, "cause", None)) if isinstance(x, BaseException))
    for line in str(exc).strip().splitlines():
        for name, code in _EXIT_CODES.items():
            if f"{name}: " in line:
                return code, line.split(f"{name}: ", 1)[1]
    return None


def _root_cause(exc: BaseException) -> str:
    """The last "XyzError: ..." line of an internal error (Ray wraps worker failures in several layers)."""
    text = str(exc).strip().splitlines()
    for line in reversed(text):
        m = re.match(r"^\s*(?:[\w.]+\.)?(\w+(?:Error|Exception|Interrupt)): (.+)$", line)
        if m and m.group(1) not in ("RaySystemError", "ControllerError", "TrainingFailedError"):
            return f"{m.group(1)}: {m.group(2)}"
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(__doc__)
        return 0
    cmd, rest = argv[0], argv[1:]
    if not any(Path(dev).exists() for dev in ("/dev/nvidiactl", "/dev/kfd")):  # no GPU driver: DeepSpeed would
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # warn about falling back to CPU (workers inherit this)
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")  # not "Creating initial MLflow database tables..."
    if cmd not in COMMANDS:
        print(f"error: unknown command {cmd!r} (commands: {', '.join(COMMANDS)})", file=sys.stderr)
        return 2
    try:
        return COMMANDS[cmd](rest)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - user errors become one line; internal ones keep their traceback
        if os.environ.get("PRETRAIN_DEBUG"):
            raise
        known = user_error(e)
        if known is not None:
            print(f"error: {known[1]}", file=sys.stderr)
            return known[0]
        traceback.print_exception(e)  # with its notes (the full log of a training run)
        print(f"error: internal error: {_root_cause(e)}", file=sys.stderr)
        return 1
