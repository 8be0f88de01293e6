"""What a run tells its user: MFU, data wait and peak memory on every logged step, per-source validation and bits
per byte, the sources as MLflow datasets and an export as a logged model — from a short real CPU run in this process
against a real local sqlite MLflow store (no mocks). The command's refusal of a bad source name is in
``tests/integration/train/test_run_insight.py``."""

from __future__ import annotations

import math
import time
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from pretrain.config import ConfigError, load_config, source_name
from tests.harness import tiny_model

ROOT = Path(__file__).resolve().parents[3]
DEMO = ROOT / "configs" / "demo-decoder.yaml"
RUN = [
    *tiny_model(hidden_size=64, max_seq_len=32, vocab_size=None),
    "data.tokenizer_vocab_size=512",
    "data.tokenizer_train_docs=2000",
    "train.global_batch_size=4",
    "train.micro_batch_size=4",
    "data.num_streams=4",
    "train.max_steps=4",
    "train.warmup_steps=1",
    "train.log_every=2",
    "train.val_every=4",
    "train.val_sequences=6",
    "checkpoint.every_steps=4",
    "cluster.use_ray=false",
    "stability.plot_at_end=false",
    "data.val_holdout=0.2",
    "eval.tasks=[heldout_lastword]",
    "eval.max_examples=12",
    "eval.num_choices=3",
]


def _two_sources(work: Path) -> list[str]:
    """The demo corpus split into two files, ``web.txt`` and ``code.txt``: two training sources."""
    from pretrain.data.demo_corpus import demo_corpus_text

    lines = demo_corpus_text().splitlines()
    (work / "web.txt").write_text("\n".join(lines[0::2]) + "\n")
    (work / "code.txt").write_text("\n".join(lines[1::2]) + "\n")
    return [f"data.sources=[{{path: {work / 'web.txt'}}}, {{path: {work / 'code.txt'}}}]"]


def test_source_names_default_to_the_stem_and_must_be_unique(tmp_path):
    assert [source_name(p) for p in ("demo", "data/web.jsonl", "corpus/code/", "allenai/c4")] == [
        "demo",
        "web",
        "code",
        "c4",
    ]
    assert source_name("data/web.jsonl", "web-en") == "web-en"
    with pytest.raises(ConfigError, match=r"data.sources\[1\].name: 'web' is also the name of data.sources\[0\]"):
        load_config(DEMO, ["data.sources=[{path: a/web.jsonl}, {path: b/web.jsonl}]"])
    with pytest.raises(ConfigError, match=r"data.val_sources\[0\].name: 'a b'"):
        load_config(DEMO, ["data.val_sources=[{path: x.txt, name: a b}]"])
    with pytest.raises(ConfigError, match="tracking.system_metrics: expected bool"):
        load_config(DEMO, ["tracking.system_metrics=maybe"])


def test_a_run_logs_speed_memory_per_source_quality_datasets_and_its_export(workdir):
    from mlflow import MlflowClient

    from pretrain.driver.prepare import prepare_new
    from pretrain.export.hf import export_checkpoint
    from pretrain.train.worker import build_trainer

    job = prepare_new(load_config(DEMO, RUN + _two_sources(workdir)))
    trainer = build_trainer(asdict(job))
    final = trainer.fit()
    client = MlflowClient()
    run = client.get_run(job.run_id)
    metrics = run.data.metrics

    def history(key):
        return {m.step: m.value for m in client.get_metric_history(job.run_id, key)}

    # on every logged step (2 and 4), MFU in (0, 1], the data-wait share in [0, 1), the peak RSS
    for key in ("train/mfu", "train/data_wait_frac", "sys/peak_rss_gb"):
        assert sorted(history(key)) == [2, 4], key
    assert all(0 < v <= 1 for v in history("train/mfu").values())
    assert all(0 <= v < 1 for v in history("train/data_wait_frac").values())
    assert all(0.05 < v < 64 for v in history("sys/peak_rss_gb").values())  # a python + torch process
    assert float(run.data.params["mfu_peak_tflops_per_worker"]) > 0 and run.data.params["mfu_peak_source"] == "measured"

    # each source's held-out share beside the aggregate; bits per byte for the aggregate and per source
    for name in ("web", "code"):
        assert math.isfinite(metrics[f"val/{name}/loss"]) and metrics[f"val/{name}/bits_per_byte"] > 0
    assert metrics["val/web/loss"] != metrics["val/code/loss"]
    assert metrics["val/bits_per_byte"] > 0 and final["val_loss"] == metrics["val/loss"]
    # bits per byte is the loss priced per byte: nats / (ln 2 * bytes) with bytes > 0 tokens' worth of text
    assert metrics["val/bits_per_byte"] < metrics["val/loss"] / math.log(2)

    # the two sources as datasets of the run (training context, a digest, the split)
    inputs = run.inputs.dataset_inputs
    assert sorted(d.dataset.name for d in inputs) == ["code", "web"]
    for d in inputs:
        tags = {t.key: t.value for t in d.tags}
        assert tags["mlflow.data.context"] == "training" and tags["split"] == "train" and tags["val_holdout"] == "0.2"
        assert len(d.dataset.digest) == 12 and str(workdir) in d.dataset.source

    # the built-in task on every validation step; offline `eval --tasks` gives the same numbers
    from eval.evaluate import evaluate_tasks
    from eval.sources import open_source

    acc = history("eval/heldout_lastword/acc")
    assert sorted(acc) == [4] and 0 <= acc[4] <= 1 and "eval/heldout_lastword/acc_norm" not in metrics
    offline = evaluate_tasks(open_source(job.run_id), ["heldout_lastword"], track=False)  # the run's eval.*
    assert offline == {"eval/heldout_lastword/acc": acc[4]}

    # an export is a logged model of its run (external: MLflow records the directory only)
    report = export_checkpoint(job.run_id, workdir / "exported")
    models = client.search_logged_models([run.info.experiment_id])
    assert len(models) == 1
    model = models[0]
    assert model.source_run_id == job.run_id and str(model.status).endswith("READY")
    assert model.tags["pretrain.export_dir"] == str(report.out) and model.params["step"] == "4"
    outputs = client.get_run(job.run_id).outputs.model_outputs
    assert [o.model_id for o in outputs] == [model.model_id]


# -- downstream tasks -----------------------------------------------------------------------------------------


class _CharTokenizer:
    """One token per character (id = code point mod 97 + 3); id 1 is the mask token."""

    mask_token_id = 1

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) % 97 + 3 for c in text]}


TASK = [
    {"context": "the cat sat on the", "choices": [" mat", " a", " sofa"], "answer": 0},
    {"context": "one two three", "choices": [" four", " five!"], "answer": 1},
    {"context": "abc", "choices": [" x", " yz"], "answer": 1, "type": "multiple_choice"},
]


def _tiny(kind):
    from pretrain.model import build_model

    cfg = load_config(
        DEMO,
        [*tiny_model(max_seq_len=32), f"model.kind={kind}"],
    )
    torch.manual_seed(3)
    return build_model(cfg.model, 0, cfg.moe).eval()


@pytest.mark.parametrize("kind", ["decoder", "encoder"])
def test_task_scores_match_a_hand_computation(tmp_path, kind):
    """acc = argmax of the summed log-probabilities of each continuation (decoders) or of the masked-LM
    pseudo-log-likelihood of its tokens (encoders); acc_norm divides by the continuation's UTF-8 bytes."""
    import json

    from pretrain.data.tasks import load_jsonl_task
    from pretrain.train.callbacks.task_evaluation import prepare_tasks, task_metrics

    path = tmp_path / "toy.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in TASK))
    task = load_jsonl_task(path, max_examples=10)
    model, tok = _tiny(kind), _CharTokenizer()
    got = task_metrics(
        lambda ids, labels: model(ids).logits, prepare_tasks([task], tok, kind, 32), kind, torch.device("cpu")
    )

    correct = correct_norm = 0
    with torch.no_grad():
        for ex in TASK:
            ctx = tok(ex["context"])["input_ids"]
            scores = []
            for choice in ex["choices"]:
                cont = tok(choice)["input_ids"]
                ids = ctx + cont
                if kind == "decoder":
                    logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
                    scores.append(sum(float(logp[len(ctx) + j - 1, t]) for j, t in enumerate(cont)))
                else:  # mask one continuation token at a time
                    total = 0.0
                    for j, t in enumerate(cont):
                        masked = list(ids)
                        masked[len(ctx) + j] = 1
                        logp = torch.log_softmax(model(torch.tensor([masked])).logits[0].double(), -1)
                        total += float(logp[len(ctx) + j, t])
                    scores.append(total)
            best = max(range(len(scores)), key=lambda i: scores[i])
            norm = [s / len(c.encode()) for s, c in zip(scores, ex["choices"])]
            correct += best == ex["answer"]
            correct_norm += max(range(len(norm)), key=lambda i: norm[i]) == ex["answer"]
    assert got == pytest.approx({"eval/toy/acc": correct / 3, "eval/toy/acc_norm": correct_norm / 3})


def test_heldout_lastword_is_deterministic_and_holds_the_true_word():
    from pretrain.data.tasks import heldout_lastword

    docs = [
        "The quick brown fox jumps over the lazy dog. A small bird sang in the early morning light. "
        "We walked along the river until the sun went down."
    ] * 3
    a = heldout_lastword(docs, max_examples=5, num_choices=3, seed=1)
    b = heldout_lastword(docs, max_examples=5, num_choices=3, seed=1)
    assert a == b and a.cloze and len(a.examples) == 5
    ex = a.examples[0]
    assert ex.context == "The quick brown fox jumps over the lazy" and ex.choices[ex.answer] == " dog"
    assert len(set(ex.choices)) == 3


def test_bad_task_values_are_one_line_config_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"eval.tasks\[0\]: 'nope.jsonl' is neither heldout_lastword"):
        load_config(DEMO, ["eval.tasks=[nope.jsonl]"])
    with pytest.raises(ConfigError, match="eval.every: must be >= 0"):
        load_config(DEMO, ["eval.every=-1"])
    with pytest.raises(ConfigError, match="eval.num_choices: must be >= 2"):
        load_config(DEMO, ["eval.num_choices=1"])
    with pytest.raises(ConfigError, match="heldout_lastword needs held-out text"):
        load_config(DEMO, ["eval.tasks=[heldout_lastword]", "data.val_holdout=0"])


def test_system_metrics_switch_logs_mlflows_own_samples(tmp_path, monkeypatch):
    """``tracking.system_metrics``: the callback runs MLflow's own sampler for the run on rank 0, which logs
    ``system/*`` metrics into a real sqlite store, and stops it at the end of the run."""
    from types import SimpleNamespace

    import mlflow

    from pretrain.train.callbacks.system_metrics import SystemMetrics

    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.2")
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLES_BEFORE_LOGGING", "1")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(tracking_uri=uri)
    run_id = client.create_run(client.create_experiment("sys", artifact_location=str(tmp_path / "art"))).info.run_id
    trainer = SimpleNamespace(
        ctx=SimpleNamespace(is_main=True),
        state=SimpleNamespace(step=0),
        tracker=SimpleNamespace(enabled=True, run_id=run_id, uri=uri),
    )
    callback = SystemMetrics()
    callback.on_run_start(trainer)
    assert callback.monitor is not None
    time.sleep(2.0)
    callback.on_run_end(trainer, {})
    assert callback.monitor is None
    logged = set(client.get_run(run_id).data.metrics)
    assert any(k.startswith("system/cpu") for k in logged), logged
    assert any(k.startswith("system/system_memory") for k in logged), logged
    # rank != 0 starts nothing
    other = SystemMetrics()
    other.on_run_start(
        SimpleNamespace(ctx=SimpleNamespace(is_main=False), tracker=trainer.tracker, state=trainer.state)
    )
    assert other.monitor is None


def test_heldout_lastword_draws_distractors_from_the_whole_vocabulary():
    """Distractors come from every part of a large held-out vocabulary, never the answer itself."""
    import random

    from pretrain.data.tasks import heldout_lastword

    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = sorted({"".join(rng.choice(letters) for _ in range(7)) for _ in range(20_000)})
    docs = [". ".join(" ".join(rng.sample(words, 8)) for _ in range(10)) + "." for _ in range(300)]
    task = heldout_lastword(docs, max_examples=400, num_choices=4, seed=1)
    firsts = set()
    for ex in task.examples:
        answer = ex.choices[ex.answer]
        others = [c for i, c in enumerate(ex.choices) if i != ex.answer]
        assert len(ex.choices) == 4 and answer not in others
        firsts.update(c.strip()[0] for c in others)
    assert firsts == set(letters), sorted(set(letters) - firsts)


def test_a_store_no_command_can_use_is_one_line_at_once(tmp_path, monkeypatch, capsys):
    """A file store (MLflow 3 refuses it) and a tracking server that does not answer are refused in one line, exit
    2, naming MLFLOW_TRACKING_URI: MLflow itself would print its traceback, after minutes of retries for a server."""
    import socket

    from pretrain.cli import main
    from pretrain.train.mlflow_records import check_store

    monkeypatch.chdir(tmp_path)
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)  # a direct connection (the machine's proxy settings aside)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for uri, says in (
        ("./mlruns", f"{tmp_path / 'mlruns'} is a file store, which MLflow 3 refuses"),
        (f"http://me:secret@127.0.0.1:{port}", f"the tracking server http://me:***@127.0.0.1:{port} does not answer"),
    ):
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        started = time.monotonic()
        assert main(["runs"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: MLFLOW_TRACKING_URI: {says}") and err.count("\n") == 1, err
        assert "secret" not in err and time.monotonic() - started < 10
    unreachable = f"http://127.0.0.1:{port}"
    check_store(unreachable, probe=False)  # a worker's tracker: the driver probed, MLflow retries
    for name in ("HTTP_PROXY", "ALL_PROXY"):  # reached through a proxy: MLflow's requests take it, a direct
        monkeypatch.setenv(name, "http://proxy.invalid:3128")  # connection would not tell
        check_store("http://mlflow.corp.invalid:5000")
        monkeypatch.delenv(name)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the user's choice: left to MLflow
    check_store(str(tmp_path / "mlruns"))
    check_store(f"sqlite:///{tmp_path / 'mlflow.db'}")
