"""Fuzz tests (hypothesis): random overrides, random YAML and random bytes or lines as corpora go through config
validation and the corpus reader; each must end in a clean refusal (ConfigError / BadRecordError, one line) or a
clean read -- never another exception, never a hang (every example runs under an alarm).

Derandomized with a fixed number of examples, so CI sees the same cases every run (explore more with a larger
``max_examples`` and ``derandomize=False``)."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import signal
import tempfile
import typing
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pretrain.config import ConfigError, DataConfig, RunConfig, SourceConfig, from_dict, load_config, to_dict
from pretrain.data.bad_records import BadRecordError
from pretrain.data.sanity import check_corpus
from pretrain.data.sources import cut_pieces, read_lines

FUZZ = settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
ALARM_SECONDS = 20


@contextlib.contextmanager
def no_hang(seconds: int = ALARM_SECONDS):
    """Fail (instead of hanging the suite) when one example runs longer than ``seconds``."""

    def on_alarm(signum, frame):
        raise TimeoutError(f"one example ran longer than {seconds} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _keys(cls: type, prefix: str = "") -> list[str]:
    out = []
    for f in dataclasses.fields(cls):
        tp = typing.get_type_hints(cls)[f.name]
        key = f"{prefix}{f.name}"
        out.append(key)
        if dataclasses.is_dataclass(tp):
            out.extend(_keys(tp, key + "."))
    return out


KEYS = _keys(RunConfig)


def assert_clean_config(load) -> RunConfig | None:
    """``load()`` gives a validated config that round-trips, or a one-line ConfigError."""
    with no_hang():
        try:
            cfg = load()
        except ConfigError as e:
            assert "\n" not in str(e) and str(e).strip(), repr(e)
            return None
    assert isinstance(cfg, RunConfig)
    assert from_dict(to_dict(cfg)) == cfg
    return cfg


# values as a user might type them after ``key=``
SCALARS = st.one_of(
    st.integers(),
    st.integers(-3, 300),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(
        [
            "true",
            "false",
            "null",
            "~",
            ".nan",
            "-.inf",
            "1e999",
            "3e-4",
            "2x",
            "+4",
            "2001-13-45",
            "[]",
            "{}",
            "[{path: demo}]",
            "[{pth: x}]",
            "[1, 2]",
            "demo",
            "decoder",
            "encoder",
            "skip",
            "fail",
            "''",
            "'",
            '"',
            "[",
            "{",
            "!!binary x",
            "!!python/object:os.system x",
            "&a [*a]",
            "0x10",
            "0o7",
            "1_000",
            "  ",
            "\t",
        ]
    ),
    st.text(max_size=20),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=6,
)


def render(value) -> str:
    if isinstance(value, str):
        return value
    try:
        return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()
    except yaml.YAMLError:
        return repr(value)


@FUZZ
@given(st.lists(st.text(max_size=40), max_size=4))
def test_random_override_strings(texts):
    assert_clean_config(lambda: load_config(None, texts))


@FUZZ
@given(
    st.lists(
        st.tuples(st.sampled_from(KEYS + ["nosuch", "model.nosuch", "data.sources.path", ""]), VALUES),
        min_size=1,
        max_size=4,
    )
)
def test_random_overrides_of_real_keys(pairs):
    overrides = [f"{key}={render(value)}" for key, value in pairs]
    assert_clean_config(lambda: load_config(None, overrides))


def _tree(keys: list[str], values: list) -> dict:
    tree: dict = {}
    for key, value in zip(keys, values):
        node = tree
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {}) if isinstance(node.get(p, {}), dict) else {}
        node[parts[-1]] = value
    return tree


@FUZZ
@given(st.lists(st.sampled_from(KEYS), max_size=6), st.lists(VALUES, max_size=6))
def test_random_yaml_trees(keys, values):
    text = yaml.safe_dump(_tree(keys, values), sort_keys=False)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "c.yaml"
        path.write_text(text)
        assert_clean_config(lambda: load_config(path))


@FUZZ
@given(
    st.one_of(
        st.text(max_size=300),
        st.binary(max_size=300),
        st.lists(
            st.sampled_from(
                [
                    "model:",
                    "  num_layers: 2",
                    "  num_layers: 3",
                    "data:",
                    "  sources:",
                    "  - path: demo",
                    "  - {path: demo, weight: .nan}",
                    "train: {lr: 1e-3}",
                    "train:",
                    "  lr: 2",
                    "<<: {}",
                    "&a x: *a",
                    "---",
                    "...",
                    "? [a]",
                    "- 1",
                    "\t",
                    "'",
                    "{",
                    "name: x",
                    "name: x",
                    "growth: {schedule: [{at_step: 1}]}",
                ]
            ),
            max_size=8,
        ).map("\n".join),
    )
)
def test_random_yaml_text_and_bytes(content):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "c.yaml"
        path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8", "surrogatepass"))
        assert_clean_config(lambda: load_config(path))


# ----------------------------------------------------------------------------------------------
# Corpora
# ----------------------------------------------------------------------------------------------


LINES = st.one_of(
    st.text(max_size=80),
    st.binary(max_size=80).map(lambda b: b.decode("latin-1")),
    st.dictionaries(
        st.sampled_from(["text", "body", "id", ""]),
        st.one_of(st.text(max_size=40), st.integers(), st.none(), st.lists(st.integers(), max_size=2)),
        max_size=3,
    ).map(json.dumps),
    st.sampled_from(
        [
            "",
            "   ",
            "{",
            "[[[[[[[[",
            "[" * 5000,
            '{"text": "\\ud800"}',
            '{"text": ""}',
            "null",
            "NaN",
            '{"text": "a fine document about rivers and mountains"}',
            "\ufeffbom line",
            "\x00\x00\x00",
        ]
    ),
)


def _write_corpus(d: Path, data, suffix: str) -> Path:
    path = d / f"corpus{suffix}"
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_bytes("\n".join(data).encode("utf-8", "surrogatepass"))
    return path


def assert_clean_corpus(path: Path, **kw) -> None:
    """The driver's check refuses in one line, or the reader reads every record cleanly (pieces included)."""
    cfg = DataConfig(sources=[SourceConfig(path=str(path))], num_streams=2, val_holdout=0.1, **kw)
    with no_hang():
        try:
            plan = check_corpus(cfg, seq_len=16, seed=0, val_sequences=4)
        except (ConfigError, BadRecordError) as e:
            assert "\n" not in str(e) and str(e).strip(), repr(e)
            return
        fmt = "json" if path.suffix == ".jsonl" else "text"
        for rec in read_lines([str(path)], fmt, "text", plan.piece_chars):
            assert set(rec) >= {"text", "bad", "msg", "file", "line"}
            if rec["bad"] is None:
                assert isinstance(rec["text"], str) and rec["text"].strip()
                rec["text"].encode("utf-8")  # hashable and tokenizable
                assert not plan.piece_chars or len(rec["text"]) <= plan.piece_chars
            else:
                assert rec["text"] is None and "\n" not in rec["msg"]


@FUZZ
@given(st.binary(max_size=4000), st.sampled_from([".txt", ".jsonl"]), st.sampled_from(["skip", "fail"]))
def test_random_bytes_as_a_corpus(data, suffix, policy):
    with tempfile.TemporaryDirectory() as d:
        assert_clean_corpus(_write_corpus(Path(d), data, suffix), bad_records=policy)


@FUZZ
@given(st.lists(LINES, max_size=40), st.sampled_from([".txt", ".jsonl"]), st.sampled_from(["skip", "fail"]))
def test_random_lines_as_a_corpus(lines, suffix, policy):
    with tempfile.TemporaryDirectory() as d:
        assert_clean_corpus(_write_corpus(Path(d), lines, suffix), bad_records=policy)


@FUZZ
@given(st.lists(st.sampled_from(["a", "b", " ", "é", "東", "\t"]), max_size=3000).map("".join), st.integers(1, 200))
def test_pieces_cover_the_text(text, size):
    pieces = list(cut_pieces(text, size))
    assert all(0 < len(p) <= size and p.strip() for p in pieces)

    # nothing but spaces at the cuts (and blank pieces) is lost, order kept
    def squeeze(s: str) -> str:
        return s.replace(" ", "").replace("\t", "")

    assert squeeze("".join(pieces)) == squeeze(text) or not text.strip()


@pytest.mark.parametrize("n", [0, 1, 7])
def test_corpus_reader_on_datasets_streams(tmp_path, n):
    """The training reader (datasets streaming over our line reader) on odd corpora the checks let through."""
    from pretrain.data import training_documents

    lines = ['{"text": "one fine document"}', "{", '{"text": "\\ud800"}', '{"body": 1}'] * n + ['{"text": "last"}']
    path = _write_corpus(tmp_path, lines, ".jsonl")
    cfg = DataConfig(sources=[SourceConfig(path=str(path))], val_holdout=0.0, num_streams=1)
    check_corpus(cfg, seq_len=4, seed=0, val_sequences=0)
    docs = list(itertools.islice(training_documents(cfg), 100))
    assert docs == ["one fine document"] * n + ["last"]
