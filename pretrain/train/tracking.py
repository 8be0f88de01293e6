"""MLflow tracking through an explicit ``MlflowClient`` (no global active run).

The tracking URI follows ``MLFLOW_TRACKING_URI``; without it, a sqlite store ``mlflow.db`` in the
working directory (resolved to an absolute path on the driver and handed to workers explicitly).
Only small things go to MLflow: params, the resolved config, checkpoint manifests and tags. Weights
stay in checkpoint storage; the run records where.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from pretrain.checkpoint import CheckpointError, layout, read_manifest
from pretrain.checkpoint.manifest import Manifest
from pretrain.config import ConfigError, RunConfig, dump_yaml, flatten, to_dict
from pretrain.config.errors import without_passwords
from pretrain.train.metric_sender import MetricSender
from pretrain.train.mlflow_records import log_datasets
from pretrain.train.mlflow_records import mlflow_client as _client
from pretrain.train.mlflow_store import shown_uri, sqlite_path

# Tags that make checkpoints discoverable from a run id.
TAG_CKPT_ROOT = "pretrain.checkpoint_root"
THREADS_TAG = "pretrain.threads_per_worker"
"""The torch threads each worker of the run trained with (its training seconds depend on them)."""
TAG_CKPT_LATEST = "pretrain.checkpoint_latest"
TAG_CKPT_STEP = "pretrain.checkpoint_step"
TAG_RESUMED_FROM = "pretrain.resumed_from"
TAG_KIND = "pretrain.model_kind"
# The experiment's kind in MLflow 3: without it, a GenAI (traces) experiment; this value is model training. The UI
# (3.17) reads it only with its browser-side workflow switch off: the links we print carry the workflow themselves
# (pretrain/driver/ui_links.py). The constants: mlflow.experimentKind, custom_model_development.
TAG_EXPERIMENT_KIND = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"


def tracking_uri() -> str:
    """``MLFLOW_TRACKING_URI`` (default ``sqlite:///mlflow.db`` here), with a relative local store made absolute:
    workers (Ray's) run in other directories and must open the same store as the driver."""
    uri = os.environ.get("MLFLOW_TRACKING_URI", "").strip() or "sqlite:///mlflow.db"
    if uri.startswith("sqlite:///") and not uri[len("sqlite:///") :].startswith("/"):
        return f"sqlite:///{(Path.cwd() / uri[len('sqlite:///') :]).resolve()}"
    if "://" not in uri and not uri.startswith("file:") and not Path(uri).is_absolute():
        return str(Path(uri).resolve())  # a local file store given as a relative path
    return uri


def has_secret(uri: str) -> bool:
    """Whether printing ``uri`` whole would print a secret (:func:`shown_uri` changes it)."""
    return shown_uri(uri) != uri


def _local_artifact_root(uri: str) -> str | None:
    """For a sqlite store, artifacts go next to the db (absolute, so workers' cwd does not matter)."""
    if uri.startswith("sqlite:///"):
        return (Path(uri[len("sqlite:///") :]).parent / "mlartifacts").resolve().as_uri()
    return None


def get_or_create_experiment(uri: str, name: str) -> str:
    """The id of experiment ``name``, created when missing; either way it is tagged as a model-training experiment
    (:data:`TAG_EXPERIMENT_KIND`) unless it has a kind already."""
    client = _client(uri)
    exp = client.get_experiment_by_name(name)
    if exp is None:
        root = _local_artifact_root(uri)
        location = f"{root}/{name}" if root else None
        try:
            return client.create_experiment(
                name, artifact_location=location, tags={TAG_EXPERIMENT_KIND: EXPERIMENT_KIND}
            )
        except Exception:  # created concurrently by another process
            exp = client.get_experiment_by_name(name)
            if exp is None:
                raise
    if TAG_EXPERIMENT_KIND not in exp.tags:  # an experiment made before, or by another tool
        client.set_experiment_tag(exp.experiment_id, TAG_EXPERIMENT_KIND, EXPERIMENT_KIND)
    return exp.experiment_id


def mark_training_experiments(uri: str) -> int:
    """Tag every experiment of the store that holds a run of ours (:data:`TAG_KIND`) but has no kind as a
    model-training experiment (:data:`TAG_EXPERIMENT_KIND`), which MLflow 3's UI would open as a GenAI one; returns
    how many it tagged."""
    client = _client(uri)
    tagged = 0
    for exp in client.search_experiments():
        if TAG_EXPERIMENT_KIND in exp.tags:
            continue
        if client.search_runs([exp.experiment_id], filter_string=f"tags.`{TAG_KIND}` != ''", max_results=1):
            client.set_experiment_tag(exp.experiment_id, TAG_EXPERIMENT_KIND, EXPERIMENT_KIND)
            tagged += 1
    return tagged


def start_run(uri: str, cfg: RunConfig, tags: dict[str, str] | None = None) -> str:
    """Create a run (:func:`new_run`) and log its inputs (:func:`log_inputs`); return the run id."""
    run_id = new_run(uri, cfg, tags)
    log_inputs(uri, run_id, cfg)
    return run_id


def new_run(uri: str, cfg: RunConfig, tags: dict[str, str] | None = None) -> str:
    """Create a run (``RUNNING``) in ``tracking.experiment``, named and tagged (a URL's password in a tag as
    ``***``: an anneal's overrides may name a source with credentials); return its id."""
    client = _client(uri)
    exp_id = get_or_create_experiment(uri, cfg.tracking.experiment)
    tags = {TAG_KIND: cfg.model.kind, **{k: without_passwords(str(v)) for k, v in (tags or {}).items()}}
    run = client.create_run(exp_id, run_name=cfg.tracking.run_name or cfg.name, tags=tags)
    return run.info.run_id


def log_inputs(uri: str, run_id: str, cfg: RunConfig) -> None:
    """The config as given (params and a YAML artifact) and the data sources as MLflow datasets."""
    log_config(uri, run_id, cfg)
    log_datasets(uri, run_id, cfg)  # MLflow's Datasets section: the sources, by name and digest


RESOLVED = "resolved."
"""The prefix of the params that record what a run derived from its config as given: ``resolved.model.vocab_size``
(the tokenizer's size), ``resolved.data.tokenizer``, ``resolved.train.max_steps`` (a FLOPs budget's steps)."""


def log_config(
    uri: str, run_id: str, cfg: RunConfig, artifact: str = "config/config.yaml", given: RunConfig | None = None
) -> None:
    """``cfg`` as a YAML artifact and as params, a URL's password in it as ``***`` (a source or an address given
    with credentials); a param the run has already keeps its first value (MLflow's params are immutable: a resume's
    config is in its artifact). With ``given`` (the config as the user gave it, logged first), ``cfg`` is its
    resolution: each value that differs is logged as ``resolved.<key>`` beside the given one, which stays what the
    run was asked to train (what ``bench --reuse`` matches)."""
    from mlflow.entities import Param

    client = _client(uri)
    flat = flatten(to_dict(cfg))
    if given is not None:
        before = flatten(to_dict(given))
        flat = {f"{RESOLVED}{k}": v for k, v in flat.items() if k not in before or before[k] != v}
    params = [Param(k, without_passwords(str(v))[:6000]) for k, v in flat.items()]
    existing = client.get_run(run_id).data.params
    params = [p for p in params if p.key not in existing]  # params are immutable in MLflow
    for i in range(0, len(params), 100):
        client.log_batch(run_id, params=params[i : i + 100], synchronous=True)
    client.log_text(run_id, without_passwords(dump_yaml(cfg)), artifact)


class Tracker:
    """Rank-0 metric logger for one run. A no-op when ``uri`` is empty (tracking disabled)."""

    def __init__(self, uri: str, run_id: str, asynchronous: bool = False, probe: bool = True):
        """``asynchronous``: metrics are queued (the training loop's tracker; see :meth:`log_metrics`); ``probe``:
        the tracking server must accept a connection at once (:func:`~pretrain.train.mlflow_records.check_store`;
        a worker's tracker does not probe: the driver did, and a server slow to answer at a worker's restart is
        MLflow's to retry)."""
        self.uri, self.run_id, self.asynchronous = uri, run_id, asynchronous
        self._client = _client(uri, probe) if uri else None
        self._sender = MetricSender(self._client, run_id, asynchronous) if self._client else None

    @property
    def enabled(self) -> bool:
        return self._client is not None

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Asynchronous trackers queue them and do not end the run while the store refuses them
        (:mod:`pretrain.train.metric_sender`); a synchronous tracker's refused write raises here."""
        if not self._sender:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._sender.log([Metric(k, float(v), now, step) for k, v in metrics.items()])

    def flush(self, final: bool = False) -> None:
        """Wait until the metrics logged so far are in the store (at most a minute; those the store refuses are
        held: :mod:`pretrain.train.metric_sender`). ``final``: the run's end (a store refusing them is given one
        more minute)."""
        if self._sender:
            self._sender.flush(final)

    def unsent(self) -> int:
        """Metric values not in the store (held while it refuses them, or dropped)."""
        return self._sender.unsent() if self._sender else 0

    def log_params(self, params: dict[str, Any]) -> bool:
        """Log params; False (nothing logged) when one of them already exists with another value (MLflow params
        are immutable, e.g. a resume on another worker count)."""
        if not self._client:
            return True
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException

        try:
            self._client.log_batch(self.run_id, params=[Param(k, str(v)) for k, v in params.items()], synchronous=True)
        except MlflowException:
            return False
        return True

    def set_tags(self, tags: dict[str, Any]) -> None:
        """Tags, a URL's password in a value as ``***`` (e.g. a data source's path in a change record)."""
        if not self._client:
            return
        from mlflow.entities import RunTag

        tags_ = [RunTag(k, without_passwords(str(v))) for k, v in tags.items()]
        self._client.log_batch(self.run_id, tags=tags_, synchronous=True)

    def log_json(self, obj: Any, artifact_file: str) -> None:
        """``obj`` as a JSON artifact, a URL's password in it as ``***``."""
        if self._client:
            text = without_passwords(json.dumps(obj, indent=1, sort_keys=True))
            self._client.log_text(self.run_id, text, artifact_file)

    def log_file(self, path: Path, artifact_dir: str) -> None:
        """Upload the file ``path`` as an artifact under ``artifact_dir``."""
        if self._client:
            self._client.log_artifact(self.run_id, str(path), artifact_dir)

    def register_checkpoint(self, path: Path, manifest: Manifest) -> None:
        """A committed checkpoint: its manifest (without the per-file list) as an artifact, plus tags."""
        if not self._client:
            return
        small = manifest.to_dict(with_files=False)
        small.update(num_files=len(manifest.files), bytes=manifest.total_bytes, path=str(path))
        self.log_json(small, f"checkpoints/{path.name}/{layout.MANIFEST}")
        self.set_tags({TAG_CKPT_LATEST: str(path), TAG_CKPT_STEP: manifest.step})

    def finish(self, status: str = "FINISHED") -> None:
        if self._client:
            self.flush(final=True)
            if self.unsent():
                print(f"warning: {self.unsent():,} metric values of run {self.run_id} are not in MLflow (its store "
                      "refused them to the end)", file=sys.stderr, flush=True)  # fmt: skip
            self._client.set_terminated(self.run_id, status=status)

    def reopen(self) -> None:
        """A run that trains again (a resume of a run that ended ``KILLED``, ``FAILED`` or ``FINISHED``) is
        ``RUNNING`` while it trains, without the tags of the stop that ended it before (:meth:`finish` ends it).
        Its end time stays the earlier stop's until then: MLflow's stores take a missing end time as "unchanged"
        (``update_run_info``), so no API call clears it."""
        if not self._client:
            return
        run = self._client.get_run(self.run_id)
        if run.info.status != "RUNNING":
            self._client.update_run(self.run_id, status="RUNNING")
        for key in [k for k in run.data.tags if k.startswith("pretrain.stop.")]:
            self._client.delete_tag(self.run_id, key)


def find_run(uri: str, run_id: str):
    """The MLflow run, or None when ``run_id`` is not a run of this tracking store (a local sqlite store that does
    not exist yet holds no run, and looking is not a reason to create it)."""
    from mlflow.exceptions import MlflowException

    if store_missing(uri):
        return None
    try:
        return _client(uri).get_run(run_id)
    except MlflowException:
        return None


LOCAL_RUN_PREFIX = "local-"
"""The id of a run made with ``tracking.enabled=false``: no store knows it."""


def run_ref(run_id: str, run_dir: str | Path) -> str:
    """How a printed command names a run: its MLflow id, or, for a run no store knows (:data:`LOCAL_RUN_PREFIX`),
    its directory, quoted for the shell where it needs it (``resume`` then makes a new run from its latest checkpoint;
    ``export`` and ``eval`` read it)."""
    import shlex

    return shlex.quote(str(run_dir)) if run_id.startswith(LOCAL_RUN_PREFIX) else run_id


def names_a_path(target: str) -> bool:
    """Whether a command's RUN_ID|PATH argument that does not exist is a path (it has a ``/`` or starts with ``.``),
    not a run id: a missing path is said to be missing, and the tracking store is not touched."""
    return "/" in target or target.startswith(".")


def run_checkpoint_root(uri: str, run_id: str) -> Path:
    """The checkpoint directory recorded for ``run_id`` (ConfigError when there is none)."""
    run = find_run(uri, run_id)
    if run is None:
        raise ConfigError(f"{run_id}: neither a checkpoint/run directory nor a run id in {shown_uri(uri)}")
    root = run.data.tags.get(TAG_CKPT_ROOT)
    if not root:
        raise ConfigError(f"{run_id}: the run has no checkpoint directory recorded")
    return Path(root)


def latest_figures(run) -> tuple[int | None, float | None]:
    """The tokens the model of ``run`` has trained on and its validation loss, both as of its latest committed
    checkpoint (its manifest: the step ``runs`` lists beside them; steps logged after it by an attempt that ended
    before its next save are not what a resume continues from); a run with no readable checkpoint, its latest
    logged ``train/tokens_seen`` and ``val/loss``. Tokens are counted like checkpoints count them (a resumed run,
    and a grown, pruned or annealed child, carry on their parent's count); None where nothing says."""
    latest = run.data.tags.get(TAG_CKPT_LATEST)
    if latest:
        try:
            manifest = read_manifest(Path(latest))
            return manifest.tokens_seen, manifest.metrics.get("val/loss")
        except (CheckpointError, OSError):  # deleted, or storage this machine does not see
            pass
    m = run.data.metrics
    return (int(m["train/tokens_seen"]) if "train/tokens_seen" in m else None), m.get("val/loss")


def store_missing(uri: str) -> bool:
    """A local sqlite store that does not exist yet (looking at it would create it)."""
    db = sqlite_path(uri)
    return db is not None and not db.exists()


def child_runs(uri: str, run) -> list:
    """The runs derived from ``run`` (``grow``, ``prune``, ``anneal``: MLflow children, ``mlflow.parentRunId``),
    oldest first."""
    return _client(uri).search_runs(
        [run.info.experiment_id],
        filter_string=f"tags.`mlflow.parentRunId` = '{run.info.run_id}'",
        order_by=["attributes.start_time ASC"],
    )


def list_runs(uri: str, max_results: int = 50) -> list:
    """The newest runs of the store, newest first (none, and nothing created, for a local store not made yet)."""
    if store_missing(uri):
        return []
    client = _client(uri)
    exps = client.search_experiments()
    if not exps:
        return []
    return client.search_runs(
        [e.experiment_id for e in exps], order_by=["attributes.start_time DESC"], max_results=max_results
    )
