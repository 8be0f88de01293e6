"""What a resume may change, through the command line: one-line refusals (exit 2) before anything starts, the run
left as it was; a run extended inside its warm-up by ``train.max_steps`` alone is the uninterrupted run; the
summary's "train longer" command continues without raising the LR; a changed corpus is refused unless
``data.allow_changed=true``, which MLflow records."""

from __future__ import annotations

import random
import re

import pytest
from mlflow import MlflowClient

from pretrain.cli import main
from pretrain.data.tokenizer import train_tokenizer
from tests.harness import CONFIG, E2E, cli, metric_history, run_id_of

RUN = [
    *[a for a in E2E if not a.startswith(("cluster.num_workers", "train.max_steps", "checkpoint.every_steps"))],
    "cluster.num_workers=1",
    "train.max_steps=6",
    "checkpoint.every_steps=3",
    "train.decay=cosine",
    "train.warmup_steps=8",  # the first 6 steps are inside the warm-up, steps 10-12 decay
]


def _corpus(path, lines: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    words = [f"w{i}" for i in range(300)]
    path.write_text("".join(" ".join(rng.choices(words, k=12)) + ".\n" for _ in range(lines)))


def _refused(capsys, *args: str) -> str:
    """The one line of a refused command (the CLI's entry point in this process: each refusal comes before any
    work, so a process of its own would time only its imports)."""
    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1, out[-2000:] + err[-3000:]
    assert "Traceback" not in out + err
    return lines[0]


def test_resume_refusals_the_summary_continuation_and_changed_data(tmp_path, monkeypatch, capsys):
    corpus = tmp_path / "corpus.txt"
    _corpus(corpus, 3000)
    data = f"data.sources=[{{path: {corpus}}}]"
    first = cli(tmp_path, "train", CONFIG, *RUN, data)
    run_id = run_id_of(first.stdout)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    assert client.get_run(run_id).info.status == "FINISHED"

    # inside the warm-up the summary's command is max_steps alone, and the run it resumes is the uninterrupted one
    assert re.search(rf"resume: .*\./launch\.sh resume {run_id} train\.max_steps=12$", first.stdout, re.M)
    line = _refused(capsys, "resume", run_id)  # a finished run: nothing left to train
    assert line.endswith("step_00000006 is at step 6: there is nothing to train. To train on: train.max_steps=12")

    # `train CONFIG checkpoint.resume_from=DIR` makes the same checks before anything is recorded (so does --dry-run,
    # which takes the checkpoint's tokenizer: the config gives none), and its fork (given the checkpoint's tokenizer,
    # and with the checkpoint's vocabulary size: the config gives none) goes on as the run did
    step3 = tmp_path / "checkpoints" / run_id / "step_00000003"
    fork = [CONFIG, *RUN, data, f"checkpoint.resume_from={step3}"]
    experiment = [client.get_run(run_id).info.experiment_id]
    runs = len(client.search_runs(experiment))
    line = _refused(capsys, "train", *fork, "model.hidden_size=128")
    assert "model.hidden_size cannot change at resume (checkpoint 64, asked 128)" in line
    line = _refused(capsys, "train", *fork, "train.max_steps=3")
    assert line.endswith("step_00000003 is at step 3: there is nothing to train. To train on: train.max_steps=6")
    other = tmp_path / "other-tokenizer"
    train_tokenizer(corpus.read_text().splitlines()[:200], 300).save_pretrained(str(other))
    for given in (other, tmp_path / "checkpoints"):  # another vocabulary; no tokenizer at all
        assert "is not the tokenizer of checkpoint" in _refused(capsys, "train", *fork, f"data.tokenizer={given}")
    assert len(client.search_runs(experiment)) == runs
    capsys.readouterr()
    assert main(["train", *fork, "--dry-run"]) == 0  # the checks pass; the plan's tokenizer is the checkpoint's
    assert f"the run trains with the checkpoint's tokenizer ({step3 / 'tokenizer'})" in capsys.readouterr().out
    forked = run_id_of(cli(tmp_path, "train", *fork, f"data.tokenizer={step3 / 'tokenizer'}").stdout)
    assert client.get_run(forked).data.tags["pretrain.resumed_from"] == str(step3)
    ours = metric_history(run_id, uri=uri)
    assert metric_history(forked, uri=uri) == {s: ours[s] for s in (4, 5, 6)}
    whole = run_id_of(cli(tmp_path, "train", CONFIG, *RUN, data, "train.max_steps=12").stdout)
    second = cli(tmp_path, "resume", run_id, "train.max_steps=12")
    for key in ("train/loss", "train/lr"):
        assert metric_history(run_id, key, uri=uri) == metric_history(whole, key, uri=uri), key
    assert sorted(metric_history(run_id, uri=uri)) == list(range(1, 13))

    # past step 9 the cosine decays: a larger max_steps would move the decay and raise the LR
    line = _refused(capsys, "resume", run_id, "train.max_steps=24")
    assert line.startswith("error: train.max_steps 12 -> 24 would raise the LR from") and "decay=wsd" in line
    line = _refused(capsys, "resume", run_id, "model.hidden_size=128")
    assert "model.hidden_size cannot change at resume (checkpoint 64, asked 128)" in line and "grow" in line
    for stage in (3, 0):  # ZeRO-0 keeps no partitioned optimizer files; ZeRO-1 keeps no optimizer in its model file
        line = _refused(capsys, "resume", run_id, f"zero.stage={stage}")
        assert f"zero.stage cannot change from 1 to {stage} at resume" in line
    line = _refused(capsys, "resume", run_id, "data.shuffle_sequences=0")
    assert "data.shuffle_sequences cannot change at resume (checkpoint 6, asked 0)" in line
    # what defines the streams: refused here, not as a worker's traceback after the run was reopened
    for override, said in (
        ("data.num_streams=4", "data.num_streams cannot change at resume (checkpoint 2, asked 4)"),
        ("model.max_seq_len=64", "model.max_seq_len cannot change at resume (checkpoint 32, asked 64)"),
        (f"data.sources=[{{path: {corpus}}}, {{path: {corpus}, name: b}}]", "data.sources cannot change at resume"),
        (f"data.sources=[{{path: {corpus}, weight: 2}}]", "data.sources[0].weight cannot change at resume"),
    ):
        line = _refused(capsys, "resume", run_id, override, "data.allow_changed=true")
        assert said in line and "export, then model.init_from_hf" in line, line

    with open(corpus, "a") as f:  # the corpus grows under the run
        f.write("an appended line.\n" * 10)
    line = _refused(capsys, "resume", run_id)
    assert re.search(rf"data changed since checkpoint \S+step_00000012: data\.sources\[0\]: {corpus} size", line)
    assert "data.allow_changed=true" in line
    assert client.get_run(run_id).info.status == "FINISHED"  # every refusal left the run as it was
    assert not client.get_run(run_id).data.tags.get("pretrain.data.changed")

    # the summary's command trains on without a jump of the LR (here: the LR reached, held), on the changed data
    longer = re.search(rf"resume: .*\./launch\.sh resume {run_id} (.+)$", second.stdout, re.M).group(1).split()
    assert longer[0] == "train.max_steps=24" and "train.decay=constant" in longer
    cli(tmp_path, "resume", run_id, *longer, "data.allow_changed=true")
    lr = metric_history(run_id, "train/lr", uri=uri)
    held = {lr[s] for s in range(13, 25)}
    assert sorted(lr)[-1] == 24 and len(held) == 1 and held.pop() == pytest.approx(lr[12], rel=1e-7)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert f"{corpus} size" in run.data.tags["pretrain.data.changed"]
    # the permission held for that resume only: the next one compares with the data it resumed on
    line = _refused(capsys, "resume", run_id, "train.max_steps=48", "model.hidden_size=32")
    assert "model.hidden_size" in line
    _corpus(corpus, 3000, seed=1)
    assert "data changed since checkpoint" in _refused(capsys, "resume", run_id, "train.max_steps=48")
