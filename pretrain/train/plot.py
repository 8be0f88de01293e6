"""A picture of a run: loss, gradient norm and stability events over steps, and the early exits' validation loss
and acceptance when the run trained with them (matplotlib, Agg).

    ./launch.sh runs RUN_ID --plot      (also drawn by rank 0 at the end of training)

Reads the metric history and the ``stability/timeline.json`` artifact of an MLflow run, or takes series
and events directly (:func:`plot_training`). A leaf module: imports nothing else from the package (matplotlib and
MLflow only, lazily); :meth:`pretrain.train.stability.control.StabilityControl.plot` and ``runs --plot`` import it.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

Series = dict[str, list[tuple[int, float]]]

SERIES = ("train/loss", "train/grad_norm", "val/loss", "train/lr")
# Marker colour per action: what the policy did about an event.
ACTION_COLORS = {"log": "tab:gray", "skip": "tab:orange", "rollback": "tab:red", "restored": "tab:red", "halt": "black"}


def history_from_mlflow(uri: str, run_id: str, keys: tuple[str, ...] = SERIES) -> Series:
    """{metric: [(step, value), ...]} in logging order (a rollback makes step numbers repeat)."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    out: Series = {}
    for key in keys:
        history = sorted(client.get_metric_history(run_id, key), key=lambda m: m.timestamp)  # stable
        if history:
            out[key] = [(m.step, m.value) for m in history]
    return out


def split_replayed(points: list[tuple[int, float]]) -> tuple[list[tuple[int, float]], list[list[tuple[int, float]]]]:
    """(the final trajectory in step order, the abandoned segments): a point is abandoned when a point
    logged later has a step at or before it — the run went back (a rollback, or a restart that replays)."""
    min_later = math.inf
    flags = []
    for step, _ in reversed(points):
        flags.append(step >= min_later)
        min_later = min(min_later, step)
    flags.reverse()
    final = [p for p, gone in zip(points, flags) if not gone]
    abandoned: list[list[tuple[int, float]]] = []
    for i, (p, gone) in enumerate(zip(points, flags)):
        if gone:
            if i == 0 or not flags[i - 1]:
                abandoned.append([])
            abandoned[-1].append(p)
    return sorted(final), abandoned


def timeline_from_mlflow(uri: str, run_id: str) -> list[dict[str, Any]]:
    """The run's stability events (empty when it has none). The artifact is downloaded into a temporary directory
    removed on return (MLflow's own default destination is a new temporary directory that nothing removes)."""
    import os
    import tempfile

    from mlflow import MlflowClient

    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    with tempfile.TemporaryDirectory(prefix="pretrain-plot-") as tmp:
        try:
            text = MlflowClient(tracking_uri=uri).download_artifacts(run_id, "stability/timeline.json", tmp)
        except Exception:  # noqa: BLE001 - no events logged
            return []
        return json.loads(Path(text).read_text()).get("timeline", [])


def exit_keys(names: Any) -> tuple[str, ...]:
    """The early exits' validation series among metric ``names`` (``val/exit_<E>/loss`` and ``/acceptance``),
    by depth E."""
    found = [n for n in names if re.fullmatch(r"val/exit_\d+/(loss|acceptance)", n)]
    return tuple(sorted(found, key=lambda n: (int(n.split("/")[1][5:]), n)))


def plot_training(series: Series, events: list[dict[str, Any]], out: Path, title: str = "") -> Path:
    """Two panels sharing the step axis: loss (train, val) and grad norm (log scale); events as vertical
    lines coloured by action, rollbacks with an arrow to the step they restored. A run with early exits gets a
    third panel: each exit's validation loss (solid, left axis) and acceptance (dashed, right axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    exits = exit_keys(series)
    if exits:
        fig, (ax_loss, ax_grad, ax_exit) = plt.subplots(3, 1, figsize=(10, 10), sharex=True, height_ratios=[3, 2, 3])
        _plot_exits(ax_exit, series, exits)
    else:
        fig, (ax_loss, ax_grad) = plt.subplots(2, 1, figsize=(10, 7), sharex=True, height_ratios=[3, 2])
    spikes: list[tuple[int, float]] = []
    for key, ax, style in (
        ("train/loss", ax_loss, "-"),
        ("val/loss", ax_loss, "o--"),
        ("train/grad_norm", ax_grad, "-"),
    ):
        final, abandoned = split_replayed(series.get(key, []))
        pts = [(s, v) for s, v in final if math.isfinite(v)]
        if pts:
            (line,) = ax.plot(*zip(*pts), style, label=key, lw=1.2, ms=4)
            for i, seg in enumerate(abandoned):  # what a rollback (or a crash before a save) threw away, faded
                seg = [(s, v) for s, v in seg if math.isfinite(v)]
                if seg:
                    ax.plot(
                        *zip(*seg),
                        style,
                        color=line.get_color(),
                        alpha=0.35,
                        lw=1.0,
                        ms=3,
                        label=f"{key} (replayed: a rollback, or a resume from before it)" if i == 0 else None,
                    )
            if key == "train/loss":
                spikes = [p for seg in abandoned for p in seg] + [p for p in final if not math.isfinite(p[1])]
        bad = [s for s, v in final if not math.isfinite(v)]
        if bad and key == "train/grad_norm":  # non-finite gradients: crosses on the bottom edge
            ax.plot(
                bad,
                [0.02] * len(bad),
                "x",
                color="tab:red",
                ms=8,
                transform=ax.get_xaxis_transform(),
                label="non-finite grad norm",
            )
    on_axis = [v for k in ("train/loss", "val/loss") for _, v in split_replayed(series.get(k, []))[0]]
    _clip_spikes(ax_loss, [v for v in on_axis if math.isfinite(v)], spikes)
    seen: set[str] = set()
    for e in events:
        color = ACTION_COLORS.get(e.get("action", ""), "tab:purple")
        label = None if e["action"] in seen else f"event -> {e['action']}"
        seen.add(e["action"])
        for ax in (ax_loss, ax_grad):
            ax.axvline(e["step"], color=color, ls=":", lw=1.2, label=label if ax is ax_loss else None)
        if e.get("kind") == "rollback" and "to_step" in e:  # an arrow back to the restored step
            tr = ax_loss.get_xaxis_transform()  # x in data, y in axes fraction
            ax_loss.annotate(
                "",
                xy=(e["to_step"], 0.88),
                xytext=(e["step"], 0.88),
                xycoords=tr,
                arrowprops={"arrowstyle": "->", "color": color},
            )
            ax_loss.text(
                (e["step"] + e["to_step"]) / 2,
                0.89,
                f"rollback to {e['to_step']}",
                color=color,
                ha="center",
                va="bottom",
                fontsize=8,
                transform=tr,
            )
    ax_loss.set_ylabel("loss")
    ax_grad.set_ylabel("grad norm (pre-clip)")
    if any(v > 0 for _, v in series.get("train/grad_norm", [])):
        ax_grad.set_yscale("log")
    (ax_exit if exits else ax_grad).set_xlabel("step")
    ax_grad.xaxis.set_major_locator(MaxNLocator(integer=True))
    if bad_grads := [s for s, v in series.get("train/grad_norm", []) if not math.isfinite(v)]:
        ax_grad.legend(loc="upper right", fontsize=8, title=f"{len(bad_grads)} non-finite")
    for ax in (ax_loss, ax_grad):
        ax.grid(alpha=0.3)
    ax_loss.legend(loc="upper right", fontsize=8)
    n_events = len(events)
    ax_loss.set_title(f"{title}  ({n_events} stability event{'s' if n_events != 1 else ''})".strip())
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _plot_exits(ax, series: Series, keys: tuple[str, ...]) -> None:
    """Per-exit validation: loss by exit on ``ax``, acceptance (fraction in [0, 1]) on a twin axis, one colour per
    exit; the full model's ``val/loss`` for reference."""
    twin = ax.twinx()
    depths = sorted({int(k.split("/")[1][5:]) for k in keys})
    for i, depth in enumerate(depths):
        color = f"C{i % 10}"
        for key, axis, style in ((f"val/exit_{depth}/loss", ax, "o-"), (f"val/exit_{depth}/acceptance", twin, "s--")):
            pts = [(s, v) for s, v in split_replayed(series.get(key, []))[0] if math.isfinite(v)]
            if pts:
                axis.plot(*zip(*pts), style, color=color, lw=1.0, ms=3, label=f"E={depth} {key.rsplit('/', 1)[1]}")
    full = [(s, v) for s, v in split_replayed(series.get("val/loss", []))[0] if math.isfinite(v)]
    if full:
        ax.plot(*zip(*full), "k:", lw=1.0, label="val/loss (full depth)")
    ax.set_ylabel("exit val loss")
    twin.set_ylabel("exit acceptance")
    twin.set_ylim(0.0, 1.0)
    ax.grid(alpha=0.3)
    lines = ax.get_legend_handles_labels()
    more = twin.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], loc="upper right", fontsize=7, ncol=2)


def _clip_spikes(ax, values: list[float], candidates: list[tuple[int, float]]) -> None:
    """Keep the loss axis on the final trajectory (``values``): rolled-back or non-finite points far above
    it become triangles at the top edge, labelled with their value."""
    if not values:
        return
    lo, hi = min(values), max(values)
    top = hi + 0.25 * max(hi - lo, 1e-3)
    ax.set_ylim(lo - 0.05 * max(hi - lo, 1e-3), top)
    for step, v in candidates:
        if not math.isfinite(v) or v > top:
            ax.plot([step], [top], "^", color="tab:red", ms=8, clip_on=False, zorder=5)
            ax.annotate(
                f"loss {v:.3g}",
                (step, top),
                textcoords="offset points",
                xytext=(-6, -4),
                ha="right",
                va="top",
                fontsize=8,
                color="tab:red",
            )


def plot_run(uri: str, run_id: str, out: Path) -> Path:
    """The PNG of an MLflow run, saved to ``out`` and logged to the run under ``plots/``."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    keys = SERIES + exit_keys(client.get_run(run_id).data.metrics)
    path = plot_training(
        history_from_mlflow(uri, run_id, keys), timeline_from_mlflow(uri, run_id), out, title=f"run {run_id}"
    )
    client.log_artifact(run_id, str(path), "plots")
    return path
