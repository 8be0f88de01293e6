"""Which remote-code directories may run their code: exactly our export's files, nothing an ``auto_map`` or an extra
Python file could add. A modified modeling file is in ``test_hf.py`` (``test_foreign_remote_code_is_not_trusted``)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from eval.hf_dir import open_hf_dir
from pretrain.config import ConfigError
from pretrain.export.hf import export_model
from pretrain.export.remote import is_our_remote_code, remote_auto_map
from tests.unit.export.test_hf import NAMED, one_thread, perturbed_state  # noqa: F401 - the autouse fixture


def evil(marker: Path) -> str:
    """A module that writes ``marker`` when it is imported (``transformers`` imports a copy of it elsewhere)."""
    return f"open({str(marker)!r}, 'w').close()\nclass Evil: pass\n"


@pytest.fixture(scope="module")
def export(tokenizer, tmp_path_factory) -> Path:
    cfg, _ = NAMED["remote-gpt2-with-bias"]
    out = tmp_path_factory.mktemp("remote") / "hf"
    export_model(cfg, perturbed_state(cfg), tokenizer, out, log=lambda *a: None)
    return out


def edited(export: Path, tmp_path: Path, name: str, change) -> Path:
    """A copy of ``export`` whose JSON file ``name`` is ``change(its content)``, with ``evil.py`` beside it."""
    out = tmp_path / "copy"
    shutil.copytree(export, out)
    (out / name).write_text(json.dumps(change(json.loads((out / name).read_text()))))
    (out / "evil.py").write_text(evil(tmp_path / "ran"))
    return out


def test_a_genuine_export_is_trusted(export):
    assert json.loads((export / "config.json").read_text())["auto_map"] == remote_auto_map("decoder")
    assert "auto_map" not in json.loads((export / "tokenizer_config.json").read_text())
    assert is_our_remote_code(export)


@pytest.mark.parametrize(
    ("name", "change", "why"),
    [
        (
            "config.json",
            lambda c: {**c, "auto_map": {**c["auto_map"], "AutoConfig": "evil.Evil"}},
            "config.json's auto_map is not the one export writes ({'AutoConfig': 'evil.Evil', ",
        ),
        (
            "tokenizer_config.json",
            lambda c: {**c, "auto_map": {"AutoTokenizer": ["evil.Evil", None]}},
            "tokenizer_config.json has an auto_map (export writes none)",
        ),
    ],
)
def test_an_auto_map_to_another_module_is_refused_before_it_runs(export, tmp_path, name, change, why):
    path = edited(export, tmp_path, name, change)
    with pytest.raises(ValueError, match="refusing to run its code") as e:
        is_our_remote_code(path)
    assert str(e.value).startswith(f"{path}: refusing to run its code: {why}") and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=f"^eval: {re.escape(str(path))}: .*refusing to run its code") as e:
        open_hf_dir(path, "eval")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "ran").exists(), "evil.py was imported"


def test_other_python_files_are_refused(export, tmp_path):
    path = tmp_path / "copy"
    shutil.copytree(export, path)
    (path / "sub").mkdir()
    (path / "sub" / "helper.py").write_text(evil(tmp_path / "ran"))
    with pytest.raises(ValueError, match=r"it holds other Python files \(sub/helper.py\)"):
        is_our_remote_code(path)
    with pytest.raises(ConfigError, match="other Python files"):
        open_hf_dir(path, "generate")
    assert not (tmp_path / "ran").exists()


@pytest.mark.parametrize("linked", [False, True])
def test_a_custom_generate_is_refused_even_behind_a_link(export, tmp_path, linked):
    """transformers runs ``custom_generate/generate.py`` of a trusted directory; ``Path.rglob`` does not enter a
    symlinked directory, so a link hid it from a search for Python files."""
    path = tmp_path / "copy"
    shutil.copytree(export, path)
    code = tmp_path / "elsewhere" if linked else path / "custom_generate"
    code.mkdir()
    (code / "generate.py").write_text(evil(tmp_path / "ran"))
    if linked:
        (path / "custom_generate").symlink_to(code, target_is_directory=True)
    with pytest.raises(ValueError, match=r"it holds a custom_generate or a linked directory \(custom_generate\)"):
        is_our_remote_code(path)
    with pytest.raises(ConfigError, match="custom_generate"):
        open_hf_dir(path, "generate")
    assert not (tmp_path / "ran").exists()


def test_other_model_types_get_no_remote_code(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "auto_map": {"AutoConfig": "evil.Evil"}}))
    (tmp_path / "evil.py").write_text(evil(tmp_path / "ran"))
    assert not is_our_remote_code(tmp_path)
    assert not is_our_remote_code(tmp_path / "missing")
