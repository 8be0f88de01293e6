"""User errors stay one short line whatever the input (pretrain/config/errors.py: ``quote``, ``clip``, ``not_a``):
a 1 MB config value, a 50 MB record, a YAML alias bomb, a FIFO where a file or directory belongs. The one-line
exits of the CLI for the usual refusals are in ``tests/unit/driver/test_console.py`` and
``tests/integration/cli/test_bad_input.py``; the synchronous save on a full disk is in
``tests/unit/checkpoint/test_snapshot.py``."""

from __future__ import annotations

import json
import os
import time
import tracemalloc
from pathlib import Path

import pytest

from pretrain.checkpoint import store
from pretrain.checkpoint.reader import find_checkpoint, pick_step
from pretrain.config import ConfigError, DataConfig, SourceConfig, load_config
from pretrain.config.errors import LIMIT, clip, quote
from pretrain.config.yaml_reading import MAX_YAML_VALUES, read_yaml
from pretrain.data import BadRecordError
from pretrain.data.sanity import check_sources
from pretrain.data.sources import resolve_source

MB = 1 << 20
SHORT = 2 * LIMIT  # the most characters of any message below


def one_short_line(e: pytest.ExceptionInfo, path: Path | None = None) -> str:
    """The error's message, asserted one line of fewer than ``SHORT`` characters (besides the list of the valid
    keys that an unknown key's message ends with, and each mention of the file ``path`` the test gave, whose length
    depends on where the test runs)."""
    msg = str(e.value)
    counted = msg.split(" (valid: ")[0].replace(str(path), "FILE") if path else msg.split(" (valid: ")[0]
    assert "\n" not in msg and len(counted) < SHORT, (len(counted), msg[:300])
    return msg


@pytest.fixture
def bounded():
    """Asserts the block's peak Python allocation and time stay below the given bounds (tracemalloc)."""

    class Bound:
        def __init__(self, mb: float, seconds: float) -> None:
            self.mb, self.seconds = mb, seconds

        def __enter__(self):
            tracemalloc.start()
            self.t0 = time.perf_counter()

        def __exit__(self, *exc):
            seconds = time.perf_counter() - self.t0
            peak = tracemalloc.get_traced_memory()[1] / MB
            tracemalloc.stop()
            if exc[0] is None:
                assert peak < self.mb and seconds < self.seconds, (peak, seconds)

    return Bound


def test_quote_and_clip_bound_any_value():
    text = "x" * MB
    assert quote(text) == repr("x" * LIMIT)[:LIMIT] + "... (1,048,576 chars)"
    assert quote(b"\x00" * 1000).endswith("... (1,000 chars)") and len(quote(b"\x00" * 1000)) < SHORT
    assert quote("ab") == "'ab'" and clip("ab") == "ab"
    assert clip("y" * 300) == "y" * LIMIT + "... (300 chars)"
    bomb: list = ["lol"] * 9
    for _ in range(9):  # 9**10 items once expanded; every level is one shared list
        bomb = [bomb] * 9
    t0 = time.perf_counter()
    assert len(quote(bomb)) <= LIMIT + 3 and time.perf_counter() - t0 < 1
    assert quote(1 << 20_000) == "<int>"  # beyond Python's digit limit of str(): no ValueError
    assert len(quote({"k" * MB: ["v" * MB] * 1000})) <= LIMIT + 3


HUGE = "x" * MB


@pytest.mark.parametrize(
    "override, start",
    [
        (f"train.lr={HUGE}", "train.lr: expected float, got str 'xxx"),
        (f"model.kind={HUGE}", "model.kind: expected one of decoder, encoder; got 'xxx"),
        (f"{HUGE}=1", "xxx"),
        (f"train.{HUGE}=1", "train.xxx"),
        (f"model.max_seq_len={'9' * 4000}", "model.max_seq_len: 999"),
        (f"growth.schedule=[{{at_step: 1, depth: {HUGE}}}]", "growth.schedule[0].depth: 'xxx"),
        (f"data.sources=[{{path: demo, name: 'a/{HUGE}'}}]", "data.sources[0].name: 'a/xxx"),
        (f"eval.tasks=[{HUGE}.jsonl]", "eval.tasks[0]: 'xxx"),
        (f"train={{lr: {HUGE}}}", "train.lr: expected float, got str 'xxx"),
    ],
    ids=["float", "literal", "key", "nested-key", "int", "growth", "source-name", "task", "section"],
)
def test_a_1mb_override_is_refused_in_one_short_line(override, start):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert one_short_line(e).startswith(start)


def test_a_1mb_value_or_key_in_a_config_file_is_one_short_line(tmp_path):
    path = tmp_path / "c.yaml"
    for text, start in (
        (f"train:\n  lr: {HUGE}\n", "train.lr: expected float, got str 'xxx"),
        (f"train:\n  ? {HUGE}\n  : 1\n", "train.xxx"),  # an explicit key: YAML's simple keys stop at 1024
        (f"train:\n  ? {HUGE}\n  : 1\n  ? {HUGE}\n  : 2\n", f"{path}: train.xxx"),  # a duplicate key
        (f"train: {{lr: 1\n{HUGE}", f"{path}: invalid YAML: "),
    ):
        path.write_text(text)
        with pytest.raises(ConfigError) as e:
            load_config(path)
        assert one_short_line(e).startswith(start)


def test_a_1mb_value_through_the_cli_is_one_short_line(capsys):
    from pretrain import cli

    assert cli.main(["train", f"train.lr={HUGE}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and len(err[0]) < SHORT and err[0].endswith("... (1,048,576 chars)")


def test_a_bad_record_on_a_50mb_line_is_one_short_line(tmp_path, bounded):
    """A record whose one field name is 50 MB, and an unterminated 50 MB JSON string: the refusal names the file
    and line, never the record; reading it holds a few copies of the line at most."""
    key = tmp_path / "key.jsonl"
    with open(key, "wb") as f:
        f.write(b'{"' + b"k" * (50 * MB) + b'": 1}\n')
    cut = tmp_path / "cut.jsonl"
    with open(cut, "wb") as f:
        f.write(b'{"text": "' + b"t" * (50 * MB) + b"\n")
    for path, reason in ((key, "missing text field ('text')"), (cut, "invalid JSON (Unterminated string")):
        cfg = DataConfig(sources=[SourceConfig(path=str(path))], bad_records="fail")
        with bounded(mb=200, seconds=10), pytest.raises(BadRecordError) as e:  # the line held 3 times
            check_sources(cfg)
        assert one_short_line(e, path).startswith(f"{path}:1: {reason}")
    # within the 1 MiB prefix under `skip`: the fields the records have are listed, each cut short
    wide = tmp_path / "wide.jsonl"
    wide.write_text(json.dumps({"f" * 500_000: 1, "g": 2}) + "\n")
    with pytest.raises(ConfigError) as e:
        check_sources(DataConfig(sources=[SourceConfig(path=str(wide))]))
    assert "the records have the fields fff" in one_short_line(e, wide)


def bomb_yaml(levels: int = 9) -> str:
    """The "billion laughs": ``levels`` nested lists of nine aliases each (9**levels values), in a few hundred
    bytes."""
    items = ["&a0 [x,x,x,x,x,x,x,x,x]"]
    items += [f"&a{i} [{','.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "[" + ", ".join(items) + "]"


def test_a_yaml_alias_bomb_is_refused_at_load(tmp_path, bounded, capsys):
    bomb = bomb_yaml()
    path = tmp_path / "bomb.yaml"
    path.write_text(f"train: {{lr: {bomb}}}\n")
    assert path.stat().st_size < 400
    bound = f"{MAX_YAML_VALUES:,}"
    with bounded(mb=20, seconds=2):
        with pytest.raises(ConfigError) as e:
            load_config(path)
        assert one_short_line(e).startswith(f"{path}: its YAML aliases (*name) expand it beyond {bound} values")
        with pytest.raises(ConfigError) as e:  # the reader of a checkpoint's config.yaml too
            read_yaml(path)
        with pytest.raises(ConfigError) as e:  # an override's value, and one that names an unknown key first
            load_config(None, [f"model.kind={bomb}"])
        assert one_short_line(e).startswith(f"model.kind: its YAML aliases (*name) expand it beyond {bound}")
        with pytest.raises(ConfigError) as e:
            load_config(None, [f"train={{lr: {bomb}}}"])
        one_short_line(e)
    from pretrain import cli

    assert cli.main(["train", str(path)]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    # a value that contains itself, and a bomb below the bound (refused by type, the message bounded)
    path.write_text("model: &m [*m]\n")
    with pytest.raises(ConfigError, match=r"refers to a value that contains it \(a recursive structure\)$"):
        load_config(path)
    path.write_text(f"train: {{lr: {bomb_yaml(5)}}}\n")  # 9**5 = 59,049 values
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert one_short_line(e).startswith("train.lr: expected float, got list [['x', 'x',")


def test_a_fifo_is_reported_as_what_it_is(tmp_path, capsys, monkeypatch):
    """A FIFO (never opened: that would block), a directory or a device given as a config file, a data source, a
    task file or a checkpoint says what it is, not "does not exist" or "no committed checkpoint"."""
    fifo = tmp_path / "pipe.yaml"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match=rf"^{fifo}: the config file is a FIFO, not a regular file$"):
        load_config(fifo)
    with pytest.raises(ConfigError, match=rf"^{tmp_path}: the config file is a directory, not a regular file$"):
        load_config(tmp_path)
    from pretrain import cli

    assert cli.main(["train", str(fifo)]) == 2
    assert capsys.readouterr().err.strip() == f"error: {fifo}: the config file is a FIFO, not a regular file"

    data = tmp_path / "data.jsonl"
    os.mkfifo(data)
    for path, what in ((data, "a FIFO"), (Path(os.devnull), "a character device")):
        with pytest.raises(ConfigError, match=rf"^data.sources\[0\].path: {path} is {what}, not a regular file$"):
            resolve_source(SourceConfig(path=str(path)), tmp_path, "data.sources[0]")
    monkeypatch.chdir(tmp_path)
    os.mkfifo("pipe")  # a relative name without an extension: not taken for a hub dataset's
    with pytest.raises(ConfigError, match=r"^data source 'pipe': pipe is a FIFO, not a regular file$"):
        resolve_source(SourceConfig(path="pipe", name="pipe"), tmp_path)
    task = tmp_path / "task.jsonl"
    os.mkfifo(task)
    with pytest.raises(ConfigError, match=rf"^eval.tasks\[0\]: '{task}' is a FIFO, not a regular file$"):
        load_config(None, [f"eval.tasks=[{task}]"])

    ckpt = tmp_path / "ckpt"
    os.mkfifo(ckpt)
    wanted = rf"^{ckpt} is a FIFO, not a directory$"
    for find in (store.resolve, store.latest_committed, find_checkpoint, lambda p: pick_step(p, 3)):
        with pytest.raises(store.CheckpointError, match=wanted):
            find(ckpt)
    assert store.list_committed(ckpt) == []  # listing (`runs`) stays quiet


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["eval.tasks=['~nosuchuser/x.jsonl']"],
            "eval.tasks[0]: '~nosuchuser/x.jsonl' is neither heldout_lastword nor",
        ),
        (["layer_drop.early_exit.layers=every:²"], "layer_drop.early_exit.layers: expected '', 'all', 'every:N' (N >="),
        (["moe.num_experts=4", "moe.ffn_size=1000000000000000000"], "moe.ffn_size: 1,000,000,000,000,000,000 is more"),
        (["checkpoint.stop_timeout_s=1e10"], "checkpoint.stop_timeout_s: 1e+10 s is more than 1e+09 s, the longest"),
        (["faults.slow_step_s=1e19"], "faults.slow_step_s: 1e+19 s is more than 1e+09 s"),
        (["tracking.experiment=''"], "tracking.experiment: empty; name the MLflow experiment"),
        (["model={num_layers: 2, num_layers: 8}"], "model: num_layers: duplicate key"),
    ],
    ids=[
        "unknown-user",
        "unicode-digit",
        "moe-ffn",
        "stop-timeout",
        "slow-step",
        "experiment",
        "dup",
    ],
)
def test_values_that_would_fail_later_are_refused_at_load(overrides, message):
    """Each of these loaded once and then failed when the run was created or mid-run (an internal error, a timer
    that never fires, a silently ignored key): now one line naming the field, at load."""
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert one_short_line(e).startswith(message), str(e.value)
