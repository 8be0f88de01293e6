"""Local paths made absolute on the driver (``pretrain/config/paths.py``)."""

from __future__ import annotations

from pretrain.config import load_config
from pretrain.config.paths import absolute, resolve_paths


def test_a_leading_tilde_is_the_home_directory(tmp_path, monkeypatch):
    home = tmp_path / "home"
    (home / "corpus").mkdir(parents=True)
    (home / "corpus" / "a.txt").write_text("x\n")
    monkeypatch.setenv("HOME", str(home))
    work = tmp_path / "work"
    assert absolute("~/ckpts", work) == str(home / "ckpts")
    assert absolute("ckpts", work) == str(work / "ckpts") and absolute("", work) == ""
    cfg = load_config(
        None,
        [
            "checkpoint.dir=~/ckpts",
            "checkpoint.resume_from=~/ckpts/run/step_00000001",
            "data.cache_dir=~/cache",
            "data.tokenizer=~/tok",
            "model.init_from_hf=~/hf",
            "data.sources=[{path: ~/corpus/a.txt}, {path: '~/corpus/*.txt'}]",
        ],
    )
    c = resolve_paths(cfg, base=work)
    assert c.checkpoint.dir == str(home / "ckpts")
    assert c.checkpoint.resume_from == str(home / "ckpts" / "run" / "step_00000001")
    assert (c.data.cache_dir, c.data.tokenizer, c.model.init_from_hf) == tuple(
        str(home / n) for n in ("cache", "tok", "hf")
    )
    assert [s.path for s in c.data.sources] == [str(home / "corpus" / "a.txt"), str(home / "corpus" / "*.txt")]


def test_task_files_are_absolute_and_a_stored_config_reads_without_them(tmp_path, monkeypatch):
    """``eval.tasks`` as written (relative to where the run started) is stored absolute: the checkpoint's config
    then reads from any directory (resume, export, eval, a Ray worker). A stored config only read (export, eval)
    reads even when the task file has gone; one that trains again (overrides: a resume) is checked."""
    import pytest

    from pretrain.config import ConfigError, to_dict

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "t.jsonl").write_text('{"context": "c", "choices": ["x", "y"], "answer": 0}\n')
    monkeypatch.chdir(tmp_path / "a")
    cfg = resolve_paths(load_config(None, ["eval.tasks=[t.jsonl, heldout_lastword]"]))
    assert cfg.eval.tasks == [str(tmp_path / "a" / "t.jsonl"), "heldout_lastword"]
    stored = to_dict(cfg)
    monkeypatch.chdir(tmp_path / "b")
    assert load_config(None, base=stored).eval.tasks == cfg.eval.tasks
    (tmp_path / "a" / "t.jsonl").unlink()
    assert load_config(None, base=stored).eval.tasks == cfg.eval.tasks  # read: an export, an eval
    with pytest.raises(ConfigError, match=r"^eval.tasks\[0\]: .*t.jsonl' is neither heldout_lastword nor an exist"):
        load_config(None, ["train.max_steps=9"], base=stored).eval.check_files()  # trains again: a resume's preflight
    # a setting that would do nothing beside another is refused in a resume's overrides as in a config as written
    with pytest.raises(ConfigError, match=r"^stability.policy: rollback returns to a good checkpoint"):
        load_config(None, ["stability.policy=rollback", "checkpoint.every_steps=0"], base=to_dict(load_config()))
