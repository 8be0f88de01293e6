"""What a resume may change, through the command line: one-line refusals (exit 2) before anything starts, the run
left as it was; the summary's "train longer" command continues without raising the LR; a changed corpus is
refused unless ``data.allow_changed=true``, which MLflow records."""

from __future__ import annotations

import random
import re

from mlflow import MlflowClient

from pretrain.cli import main
from tests.harness import CONFIG, E2E, cli, metric_history, run_id_of

RUN = [
    *[a for a in E2E if not a.startswith(("cluster.num_workers", "train.max_steps", "checkpoint.every_steps"))],
    "cluster.num_workers=1",
    "train.max_steps=6",
    "checkpoint.every_steps=3",
    "train.decay=cosine",
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
    first = cli(tmp_path, "train", CONFIG, *RUN, f"data.sources=[{{path: {corpus}}}]")
    run_id = run_id_of(first.stdout)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    assert client.get_run(run_id).info.status == "FINISHED"

    line = _refused(capsys, "resume", run_id, "train.max_steps=12")
    assert line.startswith("error: train.max_steps 6 -> 12 would raise the LR from") and "train.decay=wsd" in line
    line = _refused(capsys, "resume", run_id, "model.hidden_size=128")
    assert "model.hidden_size cannot change at resume (checkpoint 64, asked 128)" in line and "grow" in line
    line = _refused(capsys, "resume", run_id, "zero.stage=3")
    assert "zero.stage cannot change from 1 to 3 at resume" in line

    with open(corpus, "a") as f:  # the corpus grows under the run
        f.write("an appended line.\n" * 10)
    line = _refused(capsys, "resume", run_id)
    assert re.search(rf"data changed since checkpoint \S+step_00000006: data\.sources\[0\]: {corpus} size", line)
    assert "data.allow_changed=true" in line
    assert client.get_run(run_id).info.status == "FINISHED"  # every refusal left the run as it was
    assert not client.get_run(run_id).data.tags.get("pretrain.data.changed")

    # the summary's command trains on without a jump of the LR (here: the LR reached, held), on the changed data
    longer = re.search(rf"resume: .*\./launch\.sh resume {run_id} (.+)$", first.stdout, re.M).group(1).split()
    assert longer[0] == "train.max_steps=12" and "train.decay=constant" in longer
    cli(tmp_path, "resume", run_id, *longer, "data.allow_changed=true")
    lr = metric_history(run_id, "train/lr", uri=uri)
    assert sorted(lr)[-1] == 12 and max(lr[s] for s in range(7, 13)) <= lr[6] * (1 + 1e-6)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert f"{corpus} size" in run.data.tags["pretrain.data.changed"]
    # the permission held for that resume only: the next one compares with the data it resumed on
    line = _refused(capsys, "resume", run_id, "train.max_steps=12", "model.hidden_size=32")
    assert "model.hidden_size" in line
    _corpus(corpus, 3000, seed=1)
    assert "data changed since checkpoint" in _refused(capsys, "resume", run_id, "train.max_steps=12")
