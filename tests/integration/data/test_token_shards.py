"""Token shards end to end, through the real CLI and real Ray: ``tokenize`` (a Ray Data job) with 1 worker, the same
job with 2 workers SIGKILLed mid-way and finished by a rerun (byte-identical output), training on the shards with 2
workers, a bitwise resume (as 2 torchrun ranks), and the one-line refusals of a changed shard and of another
tokenizer. An elastic resume from shards (the reader states of 2 ranks merged into 1) is
``tests/unit/data/shards/test_reader.py``'s; through the CLI and Ray, on text,
``tests/integration/train/test_train_e2e.py``'s."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

from tests.harness import CONFIG, E2E, cli, metric_history, run_id_of, start_cli

WORDS = "the of and to in is was for on that with as by at from his her an which or were are this be had".split()


def _corpus(work: Path) -> list[str]:
    rng = random.Random(3)
    with open(work / "a.txt", "w") as f:
        for i in range(2500):
            f.write(f"doc {i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.choice([4, 9, 20, 45, 120]))) + "\n")
    with open(work / "b.jsonl", "w") as f:
        for i in range(600):
            f.write("{broken\n" if i == 41 else json.dumps({"text": " ".join(rng.sample(WORDS, 12))}) + "\n")
    return [str(work / "a.txt"), str(work / "b.jsonl")]


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.glob("*.npy"))}


def _settled_count(folder: Path, pattern: str, quiet: float = 2.0, limit: float = 60.0) -> int:
    """How many files match ``pattern`` in ``folder`` once none has appeared for ``quiet`` seconds: a Ray Data
    actor of a killed job can still finish the unit it was writing (atomically) until Ray's fate sharing ends it."""
    count, deadline = -1, time.time() + limit
    while time.time() < deadline:
        now = len(list(folder.glob(pattern)))
        if now == count:
            return now
        count = now
        time.sleep(quiet)
    raise AssertionError(f"{folder}: files still appearing after {limit} s")


def test_tokenize_train_resume_and_refusals(tmp_path):
    work = tmp_path
    sources = _corpus(work)
    small = ["--shard-tokens", "4000", "--chunk-bytes", "20000"]
    one = cli(work, "tokenize", *sources, "--out", "s1", "--workers", "1", "--vocab-size", "400", *small, timeout=600)
    s1 = work / "s1"
    manifest = json.loads((s1 / "manifest.json").read_text())
    assert manifest["dtype"] == "uint16" and manifest["documents"] == 2500 + 599
    assert len(manifest["shards"]) == -(-manifest["tokens"] // 4000) > 3
    assert f"{work / 'b.jsonl'}:42: invalid JSON" in one.stdout  # reported as training does: file and line
    assert manifest["bad_records"]["total"] == 1 and not (s1 / ".work").exists()

    # the same job on 2 workers, killed (driver and its embedded Ray) after its first unit, then rerun
    args = ["tokenize", *sources, "--out", "s2", "--workers", "2", "--tokenizer", str(s1 / "tokenizer"), *small]
    proc = start_cli(work, *args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    seen, deadline = [], time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        line = proc.stdout.readline()
        seen.append(line)
        if line.startswith("[tokenize] 1/"):
            break
    assert proc.poll() is None, "tokenize ended before it could be killed:\n" + "".join(seen[-30:])
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)
    assert not (work / "s2" / "manifest.json").exists()
    done_before = _settled_count(work / "s2" / ".work", "part-*.json")
    rerun = cli(work, *args, timeout=600)
    todo = re.search(r"(\d+) of (\d+) unit\(s\) to do", rerun.stdout)
    assert todo and done_before >= 1 and int(todo[1]) == int(todo[2]) - done_before, rerun.stdout
    assert _files(work / "s2") == _files(s1)  # byte for byte, whatever the workers and the crash

    # a refusal, or the answer "done already", writes nothing into --out (nor creates it)
    first = ["tokenize", *sources, "--out", "s1", "--workers", "1", "--vocab-size", "400", *small]
    before = _files(s1)
    other = cli(work, *first[: -len(small) - 2], "--vocab-size", "300", *small, expect=2)
    assert "holds the token shards of other sources or settings" in other.stderr
    assert "done already" in cli(work, *first).stdout
    assert _files(s1) == before and not (s1 / ".work").exists()
    missing = cli(work, "tokenize", *sources, "--out", "s3", "--tokenizer", str(work / "nothing"), expect=2)
    assert "tokenize --tokenizer" in missing.stderr and not (work / "s3").exists()

    # train on the shards with 2 workers; resume from step 4 bitwise
    train = [CONFIG, *E2E, f"data.sources[0].path={s1}"]
    ref = cli(work, "train", *train)
    assert "tokenizer: the token shards'" in ref.stdout
    run_id = run_id_of(ref.stdout)
    uri = f"sqlite:///{work / 'mlflow.db'}"
    losses = metric_history(run_id, uri=uri)
    assert sorted(losses) == list(range(1, 9))
    run_dir = work / "checkpoints" / run_id
    forked = cli(work, "resume", str(run_dir / "step_00000004"), "cluster.use_ray=false", ranks=2)  # torchrun
    fork = metric_history(run_id_of(forked.stdout), uri=uri)
    assert sorted(fork) == [5, 6, 7, 8] and all(fork[s] == losses[s] for s in fork), (fork, losses)

    # a changed shard is refused on resume, in one line naming it
    shard = s1 / "shard-00001.npy"
    data = shard.read_bytes()
    shard.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    bad = cli(work, "resume", run_id, expect=2)
    assert "shard-00001.npy: corrupted" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    shard.write_bytes(data)

    # a tokenizer other than the shards' is refused before any work (no run, no Ray)
    other = Path(shutil.copytree(s1 / "tokenizer", work / "other-tok"))
    spec = json.loads((other / "tokenizer.json").read_text())
    spec["added_tokens"][0]["content"] = "<|other|>"
    (other / "tokenizer.json").write_text(json.dumps(spec))
    refused = cli(work, "train", *train, f"data.tokenizer={other}", expect=2)
    assert "is not the tokenizer of the shards" in refused.stderr and "the manifest says" in refused.stderr
    assert "[pretrain] run " not in refused.stdout
