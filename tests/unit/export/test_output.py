"""``./launch.sh export ... --out DIR`` through the CLI entry point: nothing the user wrote in DIR is deleted or
overwritten (a re-export replaces only the files of the earlier export, listed in its manifest), a foreign or
user-modified directory is refused in one line with nothing changed, written files get the user's umask, and an
earlier logged model never ends up pointing at other weights (``pretrain/export/output.py``)."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

import pytest

from pretrain.cli import main
from pretrain.export.output import MANIFEST_FILE
from tests.unit.export.test_hf import (  # noqa: F401 - fixtures are used by name
    one_thread,
    perturbed_state,
    small_run_config,
    write_checkpoint,
)


def snapshot(root: Path) -> dict[str, tuple[str, int, int]]:
    """Every file under ``root``: (sha256, mode, mtime_ns)."""
    return {
        p.relative_to(root).as_posix(): (
            hashlib.sha256(p.read_bytes()).hexdigest(),
            stat.S_IMODE(p.stat().st_mode),
            p.stat().st_mtime_ns,
        )
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def export(capsys, *args: str) -> tuple[int, list[str]]:
    """Exit code of ``export ARGS`` and its ``error:`` lines (MLflow may add INFO lines of its own)."""
    code = main(["export", *args])
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return code, [line for line in err.splitlines() if line.startswith("error:")]


@pytest.fixture
def run_dir(tokenizer_dir, workdir) -> Path:
    """Two committed checkpoints (steps 3 and 6, other weights) of an untracked run."""
    cfg = small_run_config(workdir, tokenizer_dir, ["model.norm=rmsnorm", "model.activation=swiglu"])
    for step in (3, 6):
        write_checkpoint(workdir / "run", cfg, perturbed_state(cfg.model, seed=step), tokenizer_dir, step)
    return workdir / "run"


def test_reexport_replaces_only_its_own_files(run_dir, workdir, capsys):
    out = workdir / "hf"
    assert export(capsys, str(run_dir), "--out", "hf", "--step", "3", "--max-shard-size", "20KB") == (0, [])
    first = json.loads((out / MANIFEST_FILE).read_text())["files"]
    shards = sorted(n for n in first if n.startswith("model-"))
    assert len(shards) > 1 and "model.safetensors.index.json" in first
    (out / "notes.txt").write_text("my notes")
    (out / "eval").mkdir()
    (out / "eval" / "results.json").write_text("{}")
    users = {k: v for k, v in snapshot(out).items() if k in ("notes.txt", "eval/results.json")}

    assert export(capsys, str(run_dir), "--out", "hf", "--step", "6") == (0, [])
    after = snapshot(out)
    assert {k: after[k] for k in users} == users  # the user's files: untouched
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    assert "notes.txt" not in manifest["files"] and "pending" not in manifest and manifest["referenced_by"] == []
    # the earlier export's shards are gone (a single file now); the manifest lists exactly what is there
    assert not any((out / s).exists() for s in shards) and not (out / "model.safetensors.index.json").exists()
    assert set(manifest["files"]) | set(users) | {MANIFEST_FILE} == set(after)
    assert all(after[n][0] == e["sha256"] for n, e in manifest["files"].items())
    assert json.loads((out / "pretrain_export.json").read_text())["source"]["step"] == 6
    assert not [p for p in workdir.iterdir() if ".tmp-" in p.name]  # no staging dir left


def test_foreign_directory_is_refused_unchanged(run_dir, workdir, capsys):
    out = workdir / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    (out / "config.json").write_text('{"mine": true}')
    before = snapshot(out)
    code, errors = export(capsys, str(run_dir), "--out", "mine")
    assert code == 2 and len(errors) == 1, errors
    assert str(out) in errors[0] and "not an earlier export" in errors[0] and "pick another --out" in errors[0]
    assert snapshot(out) == before and sorted(p.name for p in workdir.iterdir() if ".tmp-" in p.name) == []
    # an empty directory is fine
    (workdir / "empty").mkdir()
    assert export(capsys, str(run_dir), "--out", "empty") == (0, [])
    # under a file: refused before any work, in one line
    (workdir / "afile").write_text("x")
    code, errors = export(capsys, str(run_dir), "--out", "afile/model")
    assert code == 2 and errors == [
        f"error: --out {workdir / 'afile' / 'model'}: {workdir / 'afile'} is not a directory, so the export cannot "
        f"be made there; pick another --out"
    ], errors


def test_user_modified_or_user_named_files_are_refused(run_dir, workdir, capsys):
    out = workdir / "hf"
    assert export(capsys, str(run_dir), "--out", "hf", "--step", "3") == (0, [])
    config = (out / "config.json").read_bytes()
    (out / "config.json").write_text(json.dumps({**json.loads(config), "note": "edited"}))
    before = snapshot(out)
    code, errors = export(capsys, str(run_dir), "--out", "hf", "--step", "6")
    assert code == 2 and len(errors) == 1 and "config.json was changed since" in errors[0], errors
    assert str(out) in errors[0] and snapshot(out) == before

    # the same size, other bytes: found by sha256 (after the export was verified, before anything moved)
    (out / "config.json").write_bytes(config)
    tok = out / "tokenizer.json"
    text = tok.read_text()
    tok.write_text(text.replace("<|endoftext|>", "<|ENDOFTEXT|>", 1))
    before = snapshot(out)
    code, errors = export(capsys, str(run_dir), "--out", "hf", "--step", "6")
    assert code == 2 and len(errors) == 1 and "tokenizer.json was changed since" in errors[0], errors
    assert snapshot(out) == before

    # a file the new export would write, which the earlier one did not (the user's)
    tok.write_text(text)
    (out / "model.safetensors.index.json").write_text("{}")
    before = snapshot(out)
    code, errors = export(capsys, str(run_dir), "--out", "hf", "--step", "6", "--max-shard-size", "20KB")
    assert code == 2 and len(errors) == 1, errors
    assert "model.safetensors.index.json was not written by an earlier export" in errors[0]
    assert snapshot(out) == before and not [p for p in workdir.iterdir() if ".tmp-" in p.name]


def test_an_interrupted_commit_leaves_every_file_accounted_for(run_dir, workdir, capsys, monkeypatch):
    from pretrain.export import output
    from pretrain.export.hf import export_checkpoint

    out = workdir / "hf"
    assert export(capsys, str(run_dir), "--out", "hf", "--step", "3", "--max-shard-size", "20KB") == (0, [])
    (out / "notes.txt").write_text("my notes")
    calls, replace = [], os.replace

    def dies_midway(src, dst):  # into out: the pending manifest and 3 files (new weights), then the process "dies"
        calls.extend([dst] if Path(dst).parent == out else [])
        if len(calls) == 5:
            raise OSError("killed")
        replace(src, dst)

    with monkeypatch.context() as m, pytest.raises(OSError, match="killed"):
        m.setattr(output.os, "replace", dies_midway)
        export_checkpoint(str(run_dir), out, step=6, log=lambda *a: None)
    assert "pending" in json.loads((out / MANIFEST_FILE).read_text())
    assert (out / "model.safetensors").is_file() and list(out.glob("model-0*.safetensors"))  # mixed
    assert export(capsys, str(run_dir), "--out", "hf", "--step", "6") == (0, [])
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    assert set(snapshot(out)) == set(manifest["files"]) | {MANIFEST_FILE, "notes.txt"} and "pending" not in manifest
    assert (out / "notes.txt").read_text() == "my notes"


@pytest.mark.parametrize("umask", [0o022, 0o027], ids=["umask-022", "umask-027"])
def test_written_files_follow_the_umask(run_dir, workdir, capsys, umask):
    old = os.umask(umask)
    try:
        assert export(capsys, str(run_dir), "--out", "new", "--step", "3") == (0, [])  # a new directory
        (workdir / "empty").mkdir()
        assert export(capsys, str(run_dir), "--out", "empty", "--step", "3") == (0, [])  # files moved in
        assert export(capsys, str(run_dir), "--out", "empty", "--step", "6") == (0, [])  # files replaced
    finally:
        os.umask(old)
    for out in (workdir / "new", workdir / "empty"):
        modes = {name: mode for name, (_, mode, _) in snapshot(out).items()}
        assert "model.safetensors" in modes and MANIFEST_FILE in modes
        assert set(modes.values()) == {0o666 & ~umask}, modes
    assert stat.S_IMODE((workdir / "new").stat().st_mode) == 0o777 & ~umask


def test_an_earlier_logged_model_keeps_its_weights(tokenizer_dir, workdir, capsys):
    from mlflow import MlflowClient

    from pretrain.train import tracking

    uri = tracking.tracking_uri()
    cfg = small_run_config(workdir, tokenizer_dir, ["model.norm=rmsnorm", "model.activation=swiglu"])
    run_id = tracking.start_run(uri, cfg)
    run_dir = workdir / "checkpoints" / run_id
    for step in (3, 6):
        write_checkpoint(run_dir, cfg, perturbed_state(cfg.model, seed=step), tokenizer_dir, step, run_id=run_id)
    out = workdir / "hf"
    assert export(capsys, str(run_dir), "--out", "hf", "--step", "3", "--register", "tiny") == (0, [])
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    (model,) = client.search_logged_models([client.get_run(run_id).info.experiment_id])
    assert model.tags["pretrain.export_dir"] == str(out) and model.params["step"] == "3"
    refs = json.loads((out / MANIFEST_FILE).read_text())["referenced_by"]
    assert refs == [
        {"mlflow_run": run_id, "logged_model": model.model_id},
        {"registered_model": "tiny", "version": 1},
    ]
    before = snapshot(out)

    # other weights where MLflow points: refused, nothing changed
    code, errors = export(capsys, str(run_dir), "--out", "hf", "--step", "6")
    assert code == 2 and len(errors) == 1, errors
    assert f"logged model {model.model_id} of MLflow run {run_id}" in errors[0] and "pick another --out" in errors[0]
    assert snapshot(out) == before
    assert json.loads((out / "pretrain_export.json").read_text())["source"]["step"] == int(model.params["step"])
    assert len(client.search_logged_models([client.get_run(run_id).info.experiment_id])) == 1

    # the same weights again: allowed (byte-identical files), a second logged model of the same directory
    assert export(capsys, str(run_dir), "--out", "hf", "--step", "3") == (0, [])
    assert {k: v[0] for k, v in snapshot(out).items() if k != MANIFEST_FILE} == {
        k: v[0] for k, v in before.items() if k != MANIFEST_FILE
    }
    refs = json.loads((out / MANIFEST_FILE).read_text())["referenced_by"]
    assert len(refs) == 3 and refs[:2] == [
        {"mlflow_run": run_id, "logged_model": model.model_id},
        {"registered_model": "tiny", "version": 1},
    ]
    # elsewhere: fine
    assert export(capsys, str(run_dir), "--out", "hf6", "--step", "6") == (0, [])


def test_a_malformed_shard_size_is_refused_before_any_work(run_dir, workdir, capsys):
    from pretrain.export.hf import shard_size

    sizes = ("2GB", "500mb", "1.5KB", "1000", " 5 MB ", "2GiB", "1kib")
    assert [shard_size(v) for v in sizes] == [2e9, 5e8, 1500, 1000, 5e6, 2 * 2**30, 1024]
    for bad in ("abc", "0", "-5MB", "2GiBs"):
        code, errors = export(capsys, str(run_dir), "--out", str(workdir / "out"), f"--max-shard-size={bad}")
        expected = "expected bytes (> 0), or a number with KB, MB, GB, TB (or KiB, ...)"
        assert code == 2 and errors == [f"error: export --max-shard-size: {bad!r}: {expected}"]
    assert not (workdir / "out").exists()


def test_a_data_sources_password_stays_out_of_the_export(tokenizer_dir, workdir, capsys):
    """An export is made to be shared: a data source's URL password is ``***`` in ``pretrain_export.json``, and
    ``eval`` of the export asks for the data instead of reading a URL it cannot open."""
    from pretrain.config import SourceConfig, load_config
    from pretrain.config.errors import ConfigError
    from tests.unit.export.test_hf import small_run_config

    cfg = small_run_config(workdir, tokenizer_dir, ["model.norm=rmsnorm", "model.activation=swiglu"])
    cfg.data.val_sources = [SourceConfig(path="https://alice:hunter2@data.example/val.jsonl")]
    write_checkpoint(workdir / "run", cfg, perturbed_state(cfg.model, seed=3), tokenizer_dir, 3)
    assert export(capsys, str(workdir / "run"), "--out", "hf") == (0, [])
    text = (workdir / "hf" / "pretrain_export.json").read_text()
    assert "hunter2" not in text and "https://alice:***@data.example/val.jsonl" in text
    from eval.sources import data_config_of

    data = load_config(None, base={"data": json.loads(text)["data"]}).data
    with pytest.raises(ConfigError) as e:
        data_config_of(data, "HF directory hf", [])
    assert str(e.value) == (
        "HF directory hf: its data source https://alice:***@data.example/val.jsonl needs a password the export "
        "leaves out; pass --data PATH or URL"
    )
    assert data_config_of(data, "HF directory hf", ["val.txt"]).val_sources[0].path == str(workdir / "val.txt")
    assert data_config_of(cfg.data, "a checkpoint", []) is cfg.data  # a checkpoint keeps its password
