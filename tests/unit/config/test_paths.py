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
