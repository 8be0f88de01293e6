"""``./launch.sh runs``: the tracked runs, or one run's checkpoints and lineage."""

from __future__ import annotations

from pathlib import Path

from pretrain.config import ConfigError
from pretrain.driver.ui_links import ui_base, ui_url


def runs(args: list[str]) -> int:
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
            raise ConfigError(f"{args[0]}: no such run in {tracking.shown_uri(uri)}")
        root = run.data.tags.get(tracking.TAG_CKPT_ROOT, "")
        print(f"run {args[0]} ({run.info.run_name}, {run.info.status}); checkpoints in {root}")
        print(f"  in the UI: {ui_url(ui_base(uri), run.info.experiment_id, args[0])}")
        for line in _lineage(run.data.tags):
            print(f"  {line}")
        for child in tracking.child_runs(uri, run):
            derived = child.data.tags.get("pretrain.derived", "?")
            print(f"  child: {child.info.run_id} ({child.info.run_name}): {derived}")
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
            from pretrain.train.plot import SERIES, plot_run

            if not set(SERIES) & set(run.data.metrics):  # a fresh grown child has its growth's losses only
                raise ConfigError(f"runs --plot: run {args[0]} has logged no metrics yet: there is nothing to plot")

            out = Path(root) / "training.png" if root and Path(root).is_dir() else Path(f"{args[0]}.png")
            print(f"plot: {plot_run(uri, args[0], out).resolve()}")
        return 0
    runs = tracking.list_runs(uri)
    if not runs:
        missing = tracking.store_missing(uri)
        print(
            f"no runs in {tracking.shown_uri(uri)}"
            + (" (no store there: run this where you trained, or set MLFLOW_TRACKING_URI)" if missing else "")
        )
        return 0
    print(f"tracking store: {tracking.shown_uri(uri)}")
    w = max(4, *(len(r.info.run_name or "") for r in runs))  # whole names: a child's differs at its end
    print(f"{'run id':<34} {'name':<{w}} {'status':<9} {'step':>6} {'tokens':>13} {'val loss':>8}  latest checkpoint")
    for r in runs:
        tags = r.data.tags
        step = tags.get(tracking.TAG_CKPT_STEP, "-")
        tokens, val = tracking.latest_figures(r)
        print(
            f"{r.info.run_id:<34} {r.info.run_name or '':<{w}} {r.info.status:<9} {step:>6} "
            f"{'-' if tokens is None else f'{tokens:,}':>13} {float('nan') if val is None else val:>8.4f}  "
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
