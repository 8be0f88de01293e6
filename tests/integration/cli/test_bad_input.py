"""Bad input through the command line: one-line refusals (exit 2, no traceback, no Ray, within 2 seconds) of bad
corpora, configs and checkpoint directories, and a corpus of one huge document trained with the sequence-level
split."""

from __future__ import annotations

import json
import random
import subprocess
import time
from pathlib import Path

import pytest

from pretrain.config import load_config
from tests.conftest import ROOT
from tests.harness import cli
from tests.unit.data.test_sanity import words

CONFIG = str(ROOT / "configs" / "demo-decoder.yaml")


# ----------------------------------------------------------------------------------------------
# The CLI: exit 2, one line, no traceback, no Ray, at once
# ----------------------------------------------------------------------------------------------


def timed_train(tmp_path: Path, *args: str, expect: int = 2) -> tuple[subprocess.CompletedProcess, float]:
    """``train ARGS`` through ``cli`` (exit ``expect``; no MLflow store made for it) and its wall time in seconds."""
    start = time.perf_counter()
    proc = cli(tmp_path, "train", *args, expect=expect, timeout=120, store=False)
    return proc, time.perf_counter() - start


def assert_refused(proc: subprocess.CompletedProcess, *needles: str) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "ray" not in (proc.stdout + proc.stderr).lower()
    assert all(n in lines[0] for n in needles), lines[0]
    return lines[0]


def test_cli_refuses_a_corrupt_corpus_at_once(tmp_path):
    rnd = tmp_path / "random.txt"
    rnd.write_bytes(random.Random(0).randbytes(200_000))
    proc, seconds = timed_train(tmp_path, CONFIG, f"data.sources=[{{path: {rnd}}}]", "train.max_steps=2")
    assert_refused(proc, "data.sources[0]", str(rnd), "not text")
    assert seconds < 2.0, seconds
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "mlflow.db").exists()


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        ((CONFIG, "model.max_seq_len=1"), ("model.max_seq_len",)),
        (  # early-exit training is for decoders
            (str(ROOT / "configs" / "demo-encoder.yaml"), "layer_drop.early_exit.layers=all"),
            ("layer_drop.early_exit.layers", "decoders"),
        ),
    ],
    ids=["max_seq_len", "early-exit-encoder"],
)
def test_cli_refuses_config_errors_at_once(tmp_path, args, needles):
    proc, seconds = timed_train(tmp_path, *args)
    assert_refused(proc, *needles)
    assert seconds < 2.0, seconds


@pytest.mark.parametrize("case", ["empty", "nofield", "nofile", "vocab", "ckpt", "dup", "emptycfg", "fail"])
def test_cli_refusals(tmp_path, case):
    jsonl = tmp_path / "x.jsonl"
    args = [CONFIG, "train.max_steps=2", f"data.sources=[{{path: {jsonl}}}]"]
    if case == "empty":
        jsonl.write_text("")
        needles = ["data.sources[0]", str(jsonl), "empty"]
    elif case == "nofield":
        jsonl.write_text('{"body": "x"}\n' * 5)
        needles = ["data.sources[0]", "text_field", "body"]
    elif case == "nofile":
        args[-1] = f"data.sources=[{{path: {tmp_path}/*.jsonl}}]"
        needles = ["data.sources[0].path", "no file matches"]
    elif case == "vocab":
        args = [CONFIG, "data.tokenizer_vocab_size=3"]
        needles = ["data.tokenizer_vocab_size"]
    elif case == "ckpt":
        (tmp_path / "afile").write_text("x")
        args = [CONFIG, f"checkpoint.dir={tmp_path}/afile/ckpt"]
        needles = ["checkpoint.dir"]
    elif case == "dup":
        cfg = tmp_path / "dup.yaml"
        cfg.write_text("model:\n  num_layers: 2\ntrain:\n  lr: 1.0e-3\n  lr: 2.0e-3\n")
        args = [str(cfg)]
        needles = ["train.lr: duplicate key (lines 4 and 5)"]
    elif case == "emptycfg":
        cfg = tmp_path / "empty.yaml"
        cfg.write_text("# nothing here\n")
        args = [str(cfg)]
        needles = ["empty.yaml: the config file is empty"]
    else:
        good = json.dumps({"text": "a fine line of text"})
        jsonl.write_text(f"{good}\n{good}\n{{broken\n{good}\n")
        args.append("data.bad_records=fail")
        needles = [f"{jsonl}:3: invalid JSON"]
    proc, seconds = timed_train(tmp_path, *args)
    assert_refused(proc, *needles)
    assert seconds < 10.0, seconds  # nothing heavy started (the 2 s bound is asserted above, twice)


def test_cli_trains_a_single_huge_document(tmp_path):
    """One 2 MB line, no newline: the driver says it falls back to a sequence-level split, and training runs."""
    huge = tmp_path / "huge.txt"
    huge.write_text(words(400_000, 1)[:2_000_000])
    args = [
        CONFIG,
        f"data.sources=[{{path: {huge}}}]",
        "train.max_steps=2",
        "cluster.use_ray=false",
        "model.num_layers=1",
        "model.hidden_size=64",
        "data.tokenizer_vocab_size=512",
        "train.val_sequences=4",
        "stability.plot_at_end=false",
    ]
    proc, _ = timed_train(tmp_path, *args, expect=0)
    notes = [line for line in proc.stdout.splitlines() if "sequence-level split" in line]
    assert len(notes) == 1 and notes[0].startswith("[pretrain] data: 1 document ("), proc.stdout[-3000:]
    assert "final val loss" in proc.stdout
    cfg = load_config(next((tmp_path / "checkpoints").glob("*/config.yaml")))
    assert cfg.data.piece_chars == 512
