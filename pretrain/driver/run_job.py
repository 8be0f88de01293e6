"""Running a prepared job from the command line (``train``, ``resume``): a quiet terminal, the run's stop
handling (:mod:`pretrain.driver.signals`), its MLflow status, and the lines a user reads at the end — the summary
with the next commands, or the one line of a stopped run."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import sys
from pathlib import Path


def print_summary(final: dict, job, uri: str) -> None:
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
    if final.get("plot"):  # read from the summary: a worker's own line may reach this terminal late or not at all
        rows.append(("training plot", final["plot"]))
    if final.get("bad_records"):
        rows.append(("bad records", f"{final['bad_records']} skipped (see data/bad_records.json in the run)"))
    print(f"\n== finished: {cfg_name} ==")
    for k, v in rows:
        print(f"  {k:<18} {v}")
    env = _store_prefix(uri)
    from pretrain.config import from_dict
    from pretrain.driver.ui_links import run_url
    from pretrain.invocation import command
    from pretrain.train.schedule import decayed_out, resume_overrides
    from pretrain.train.tracking import has_secret, run_ref

    train, step = from_dict(job.config).train, int(final.get("step", 0))
    longer = resume_overrides(train, step)  # no LR jump, no new warm-up
    cmd, ref = env + command(), run_ref(run_id, job.run_dir)
    out = decayed_out(train, step) if step >= train.max_steps else ""
    print("\n  resume:      " + (f"none: {out}" if out else f"{cmd} resume {ref}{' ' + longer if longer else ''}"))
    print("  export:      " + f"{cmd} export {ref} --out exported/{run_id}")
    if not uri.startswith(("http://", "https://")):  # a tracking server serves its own UI: the link below
        plain = f"   (or: .venv/bin/mlflow ui --backend-store-uri {shlex.quote(uri)} --host 127.0.0.1 --port 5000)"
        print(f"  MLflow UI:   {cmd} ui" + ("" if has_secret(uri) else plain))  # never a password
    link = run_url(job.tracking_uri, run_id)
    if link:
        print("  run in UI:   " + link)


def run_job(prepare, announce) -> int:
    """``prepare(held)`` the job (returns it and whether it started Ray, which is then shut down at the end) and run
    it, the terminal quiet from the start (:class:`QuietConsole`: the log goes into the run directory once the
    run exists). ``held``: an ExitStack that keeps what ``prepare`` enters into it (the run's lock,
    :mod:`pretrain.driver.run_lock`) until the run has ended. ``announce(job)``: the line that names the run.
    A stop before the run trains ends the command at once (:func:`~pretrain.driver.signals.stop_at_once`), and the
    run, if created, ``KILLED``; a stop once it has trained waits for the run's end to be recorded."""
    from cluster.launch import run
    from cluster.ray_process import end_ray_with_process, stop_ray
    from pretrain.config import from_dict
    from pretrain.driver.console import QuietConsole
    from pretrain.driver.launched import follow, launched
    from pretrain.driver.signals import StopNow, StopSignals, stop_at_once
    from pretrain.train.stop_request import stops_deferred
    from pretrain.train.tracking import Tracker, tracking_uri

    launch = launched()
    if launch is not None and not launch.leads:  # torchrun: rank 0 prepares and tracks the run
        return follow(launch)
    with QuietConsole(None) as console, contextlib.ExitStack() as held, stop_at_once():
        job, ray_started = prepare(held)
        stop: StopSignals | None = None
        log = Path(job.run_dir) / "logs" / "driver.log"
        try:
            try:
                tracker = Tracker(job.tracking_uri, job.run_id)
                tracker.reopen()  # a resumed run trains again: RUNNING until its end is recorded
                cfg = from_dict(job.config)
                stop = StopSignals(job.run_dir, cfg.checkpoint.on_stop, cfg.checkpoint.stop_timeout_s)
                if launch is not None:
                    launch.publish(job)
                    launch.note_run(job)
                console.set_log(log)
                print(f"[pretrain] {announce(job)}", flush=True)
                print(f"[pretrain] full log (Ray, DeepSpeed, every worker): {log}", flush=True)
                with stop:
                    final = run(job, cfg.cluster)
            except BaseException:
                stop_ray(ray_started)
                raise
            with stops_deferred("ending the run, which has trained (SIGKILL ends at once)"):
                end_ray_with_process(ray_started)  # the command ends right after the summary
                stopped = _record_end(tracker, final)
        except BaseException as e:
            if isinstance(e, KeyboardInterrupt):  # Ctrl-C, or a stop that could not wait for its checkpoint
                signum = (stop.signum if stop else 0) or getattr(e, "signum", signal.SIGINT)
                raise StopNow(signum, end_stopped_at_once(job, signum)) from e
            with contextlib.suppress(Exception):  # the error itself matters more than its record
                Tracker(job.tracking_uri, job.run_id).finish("FAILED")
            e.add_note(f"full log: {log}")
            raise
    if stopped:
        return _print_stopped(final, job, (stop.signum if stop else 0) or signal.SIGTERM)
    print_summary(final, job, tracking_uri())
    return 0


def _record_end(tracker, final: dict) -> dict | None:
    """The MLflow status of a run that has trained: ``KILLED`` with the stop's tags when a stop ended it with a
    checkpoint (returned: ``final["stopped"]``), else ``FINISHED``."""
    stopped = final.get("stopped")
    if stopped:
        tracker.set_tags(
            {
                "pretrain.stop.signal": stopped["signal"],
                "pretrain.stop.step": stopped["step"],
                "pretrain.stop.checkpoint": final.get("checkpoint", ""),
            }
        )
    tracker.finish("KILLED" if stopped else "FINISHED")
    return stopped


def abandon(job, error: BaseException) -> None:
    """``job``'s run was created while the command failed or was stopped (:func:`cluster.launch.
    prepare_while_ray_starts`): it ends ``FAILED``, or for a stop ``KILLED`` with the stop's line."""
    from pretrain.driver.signals import StopNow
    from pretrain.train.tracking import Tracker

    if isinstance(error, KeyboardInterrupt):
        signum = getattr(error, "signum", signal.SIGINT)
        raise StopNow(signum, end_stopped_at_once(job, signum)) from error
    with contextlib.suppress(Exception):  # the error itself matters more than its record
        Tracker(job.tracking_uri, job.run_id).finish("FAILED")


def end_stopped_at_once(job, signum: int) -> str:
    """``job``'s run ends ``KILLED`` by a stop (signal ``signum``) that wrote no checkpoint, recorded in its tags (a
    store that cannot be reached records nothing); returns the line that says where its latest committed checkpoint
    is."""
    from pretrain.driver.prepare import stop_tags
    from pretrain.train.stop_request import stops_deferred
    from pretrain.train.tracking import Tracker

    tags = stop_tags(signum)
    with stops_deferred("ending the run KILLED (SIGKILL ends at once)"), contextlib.suppress(Exception):
        tracker = Tracker(job.tracking_uri, job.run_id)
        tracker.set_tags(tags)
        tracker.finish("KILLED")
    return _stopped_at_once(tags["pretrain.stop.signal"], job)


def _stopped_at_once(signame: str, job) -> str:
    """The line of a run that a stop ended without a new checkpoint: where the latest committed one is."""
    from pretrain.checkpoint import CheckpointError, latest_committed

    try:
        last = latest_committed(Path(job.run_dir), full=False)
    except CheckpointError as e:  # the newest is damaged: the error names the one to resume from
        return f"{signame}: stopped at once, no new checkpoint; {e}"
    if last is None:
        return f"{signame}: stopped at once; the run has no committed checkpoint, so there is nothing to resume"
    return (
        f"{signame}: stopped at once, no new checkpoint; latest committed checkpoint {last.path}; "
        f"resume: {_resume_command(job, last.step)}"
    )


def _resume_command(job, step: int) -> str:
    """``./launch.sh resume RUN_ID`` (the prefix: :func:`pretrain.invocation.command`) from a checkpoint at
    ``step``, with the tracking store when the user set one in the environment; at the run's last step, with the
    overrides that train on (a bare resume has nothing to do)."""
    from pretrain.config import from_dict
    from pretrain.invocation import command
    from pretrain.train.schedule import resume_overrides
    from pretrain.train.tracking import run_ref, tracking_uri

    env = _store_prefix(tracking_uri())
    longer = resume_overrides(from_dict(job.config).train, step)
    return f"{env}{command()} resume {run_ref(job.run_id, job.run_dir)}{' ' + longer if longer else ''}"


def _store_prefix(uri: str) -> str:
    """``MLFLOW_TRACKING_URI=... `` before a printed command when the user set the store in the environment, so the
    command works from another shell; nothing when the URI holds a password (never printed: the shell that has it
    set runs the command as it is)."""
    from pretrain.train.tracking import has_secret

    if "MLFLOW_TRACKING_URI" not in os.environ or has_secret(uri):
        return ""
    return f"MLFLOW_TRACKING_URI={shlex.quote(uri)} "


def _print_stopped(final: dict, job, signum: int) -> int:
    """The one line of a run that a stop ended with a checkpoint; the command's exit status (143, 130)."""
    from pretrain.driver.signals import exit_code

    where = final.get("checkpoint") or "no checkpoint (none was written)"
    print(
        f"stopped by {final['stopped']['signal']} at step {final['stopped']['step']}: checkpoint {where}; "
        f"resume: {_resume_command(job, int(final['stopped']['step']))}",
        file=sys.stderr,
    )
    return exit_code(signum)
