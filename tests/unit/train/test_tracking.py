"""The MLflow store a run uses: a relative local store is made absolute on the driver, so Ray workers (which run
in other directories) open the same store (a relative one gave them an empty store: 'Run ... not found')."""

import types

import pytest

from pretrain.train.tracking import tracking_uri


def test_relative_stores_are_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for given, want in [
        ("", f"sqlite:///{tmp_path / 'mlflow.db'}"),
        ("sqlite:///sub/m.db", f"sqlite:///{tmp_path / 'sub' / 'm.db'}"),
        ("sqlite:////abs/m.db", "sqlite:////abs/m.db"),
        ("mlruns", str(tmp_path / "mlruns")),
        ("http://127.0.0.1:5000", "http://127.0.0.1:5000"),
    ]:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", given)
        assert tracking_uri() == want, given


def test_looking_up_a_run_creates_no_store(tmp_path, monkeypatch, capsys):
    """A run id that is not a run (or a path that does not exist) is one line, and the directory the user ran the
    command in gets no new ``mlflow.db``."""
    from pretrain.cli import main
    from pretrain.train.tracking import find_run

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert find_run(tracking_uri(), "0123abcd") is None
    assert main(["runs"]) == 0
    assert (
        capsys.readouterr().out
        == f"no runs in {tracking_uri()} (no store there: run this where you trained, or set MLFLOW_TRACKING_URI)\n"
    )
    for argv, error in [
        (["runs", "0123abcd"], f"0123abcd: no such run in {tracking_uri()}"),
        (["verify", "/no/such"], "verify: /no/such: no such checkpoint or run directory"),
        (["verify", "0123abcd"], f"0123abcd: neither a checkpoint/run directory nor a run id in {tracking_uri()}"),
        (["export", "0123abcd", "--out", "x"], "0123abcd: neither a checkpoint/run directory nor a run id in"),
    ]:
        assert main(argv) == 2
        assert capsys.readouterr().err.splitlines()[-1].startswith(f"error: {error}"), argv
    assert list(tmp_path.iterdir()) == []


def test_a_run_with_no_metrics_is_not_plotted(workdir, capsys):
    """``runs RUN --plot`` of a run that has logged nothing yet (a fresh grown child, a run stopped while it
    started) is one line, and no empty picture is written."""
    from mlflow import MlflowClient

    from pretrain.cli import main

    client = MlflowClient(tracking_uri())
    run_id = client.create_run("0").info.run_id
    client.log_metric(run_id, "growth/loss_before", 3.0, step=0)  # what a grown child logs at its creation
    client.log_metric(run_id, "growth/loss_after", 3.0, step=0)
    assert main(["runs", run_id, "--plot"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("20")]  # MLflow's INFO
    assert errors == [f"error: runs --plot: run {run_id} has logged no metrics yet: there is nothing to plot"]
    assert not list(workdir.glob("*.png"))


def test_a_resumed_run_is_running_again_without_its_old_stop(tmp_path):
    """A run stopped (``KILLED``, with the stop's tags) and resumed is ``RUNNING`` while it trains again, without
    the old stop's tags; other tags stay (a real sqlite store)."""
    from mlflow import MlflowClient

    from pretrain.train.tracking import Tracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("x"), tags={"pretrain.kind": "decoder"}).info.run_id
    client.set_tag(run_id, "pretrain.stop.signal", "SIGTERM")
    client.set_terminated(run_id, "KILLED")
    tracker = Tracker(uri, run_id)
    tracker.reopen()
    run = client.get_run(run_id)
    assert run.info.status == "RUNNING" and "pretrain.stop.signal" not in run.data.tags
    assert run.data.tags["pretrain.kind"] == "decoder"
    tracker.finish("FINISHED")
    assert client.get_run(run_id).info.status == "FINISHED"


def test_a_password_in_a_url_of_the_config_stays_out_of_mlflow(tmp_path):
    """A source given as a URL with credentials: params, the config artifacts, the dataset record, tags and JSON
    artifacts (a resume's data-change record) show ``***`` where the password was (the run directory's own config
    keeps it: a resume needs it)."""
    from mlflow import MlflowClient

    from pretrain.config import load_config
    from pretrain.train.tracking import Tracker, log_config, log_inputs, new_run

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    cfg = load_config(None, ["data.sources=[{path: 'https://alice:s3cr3t-T0KEN@data.example/c.jsonl', name: web}]"])
    url = cfg.data.sources[0].path
    run_id = new_run(uri, cfg, {"anneal.overrides": f"steps=5 data.sources=[{{path: {url}}}]"})  # a derived run's
    log_inputs(uri, run_id, cfg)
    log_config(uri, run_id, cfg, artifact="config/resolved.yaml")
    Tracker(uri, run_id).set_tags({"pretrain.data.changed": f"data.sources[0].path {url} -> /data/c.jsonl"})
    Tracker(uri, run_id).log_json({"data.sources[0]": {"path": url}}, "data/fingerprint.json")
    run = client.get_run(run_id)
    logged = [*run.data.params.values(), *run.data.tags.values()]
    logged += [d.dataset.source for d in run.inputs.dataset_inputs]
    for artifact in ("config/config.yaml", "config/resolved.yaml", "data/fingerprint.json"):
        logged.append(open(client.download_artifacts(run_id, artifact, str(tmp_path))).read())
    assert not [text for text in logged if "s3cr3t" in text]
    assert "https://alice:***@data.example/c.jsonl" in run.data.params["data.sources"]


def test_a_tracking_store_that_refuses_metrics_for_a_while_does_not_end_the_run(monkeypatch, capsys):
    """MLflow retries a write for about four minutes, then the asynchronous write fails. The training loop's sender
    then holds its metrics (at most HELD_LIMIT values, the oldest dropped beyond) and sends nothing but one small
    probe at a time, in a thread of its own, so the loop waits on no write; once a probe succeeds, every held value
    is sent with its own step. One warning when the store starts refusing, one when it takes them again. A write
    with no answer within WAIT_S counts as refused."""
    from concurrent.futures import Future

    from mlflow.exceptions import MlflowException
    from mlflow.utils.async_logging.run_operations import RunOperations

    from pretrain.train import metric_sender
    from pretrain.train.metric_sender import MetricSender

    class Store:
        """log_batch as MLflow's client does it: asynchronous, a future per call; refused while the server is down."""

        def __init__(self):
            self.down, self.kept, self.calls = True, [], 0

        def log_batch(self, run_id, metrics, synchronous):
            self.calls += 1
            if self.down and synchronous:
                raise MlflowException("API request to http://mlflow:5000 failed: max retries")
            future: Future = Future()
            if self.down:
                future.set_exception(MlflowException("API request to http://mlflow:5000 failed: max retries"))
            else:
                self.kept.extend((m.key, m.step, m.value) for m in metrics)
                future.set_result(None)
            return None if synchronous else RunOperations([future])

    from mlflow.entities import Metric

    def batch(step: int) -> list:
        return [Metric("train/loss", float(step), step, step)]

    store = Store()
    monkeypatch.setattr(metric_sender, "HELD_LIMIT", 100)
    monkeypatch.setattr(metric_sender, "CHUNK", 10)
    sender = MetricSender(store, "r", asynchronous=True)
    for step in range(1, 66):  # the 65th call waits for the first 64 writes: refused, so held
        sender.log(batch(step))
    assert sender.holding and "warning: MLflow did not take 64 metric values" in capsys.readouterr().err
    for step in range(66, 131):  # held: no write but the probes (one at a time, each refused)
        sender.log(batch(step))
        if sender._probe:
            sender._probe[0].exception()  # (the probe's thread has run)
    assert store.calls <= 64 + 1 + 65 and sender.unsent() == 130 and sender._dropped == 30  # at most a probe a call
    store.down = False
    sender.flush(final=True)  # the probe succeeds: the held values are sent, then waited for
    assert not sender.holding and sender.unsent() == 0
    assert sorted(s for _, s, _ in store.kept) == list(range(31, 131))
    assert "takes metrics again (the 100 values held are sent; 30 older ones were dropped)" in capsys.readouterr().err

    # a write with no answer within WAIT_S is held too (the loop does not wait out MLflow's retries)
    monkeypatch.setattr(metric_sender, "WAIT_S", 0.05)
    import threading

    def no_answer(run_id, metrics, synchronous):  # queued: a future never done; the probe: a call never returning
        return threading.Event().wait() if synchronous else RunOperations([Future()])

    silent = MetricSender(types.SimpleNamespace(log_batch=no_answer), "r", True)
    silent.log(batch(1))
    silent.flush()
    assert silent.holding and silent.unsent() == 1

    # a probe the store answers and refuses for what it holds is dropped (counted), not held again for ever
    from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

    def refuses(run_id, metrics, synchronous):
        raise MlflowException("bad metric", error_code=INVALID_PARAMETER_VALUE)

    refused = MetricSender(types.SimpleNamespace(log_batch=refuses), "r", True)
    refused.holding, refused._held = True, batch(1)
    refused.flush(final=True)
    assert not refused.holding and refused.unsent() == 1 and refused._dropped == 1

    synchronous = MetricSender(
        types.SimpleNamespace(log_batch=lambda *a, **k: (_ for _ in ()).throw(MlflowException("x"))), "r", False
    )
    with pytest.raises(MlflowException):  # a command's own records (not the loop's): the error is its caller's
        synchronous.log(batch(1))
