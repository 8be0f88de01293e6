"""Keys that moved (``pretrain/config/moved.py``): a user's config naming an old key is refused at load with exit 2
and one line naming the new key; a config stored by an older version (a checkpoint's) is migrated and loads."""

from __future__ import annotations

import shutil

import pytest
import yaml

from pretrain.config import ConfigError, load_config, to_dict
from pretrain.config.moved import MOVED, migrate
from tests.conftest import FIXTURES

OLD_VALUES = {"cluster.sequence_parallel": 2, "cluster.tensor_parallel": 2, "moe.ep_size": 2}


def test_every_moved_key_is_named():
    assert MOVED == {
        "cluster.sequence_parallel": "parallel.sequence",
        "cluster.tensor_parallel": "parallel.tensor",
        "moe.ep_size": "parallel.expert",
    }


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_key_is_refused_in_one_line(old, tmp_path, capsys):
    from pretrain.cli import main

    want = f"{old}: moved; use {MOVED[old]}"
    with pytest.raises(ConfigError) as e:  # a dotted override
        load_config(None, [f"{old}={OLD_VALUES[old]}"])
    assert str(e.value) == want
    section, key = old.split(".")
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump({section: {key: OLD_VALUES[old]}}))
    with pytest.raises(ConfigError) as e:  # a YAML file
        load_config(path)
    assert str(e.value) == want
    capsys.readouterr()
    assert main(["train", str(path), "--dry-run"]) == 2
    assert capsys.readouterr().err.strip() == f"error: {want}"


def test_a_stored_config_is_migrated():
    stored = to_dict(load_config(None, ["moe.num_experts=4", "zero.stage=1", "cluster.num_workers=2"]))
    del stored["parallel"]
    stored["cluster"].update(sequence_parallel=1, tensor_parallel=1)
    stored["moe"]["ep_size"] = 2
    migrated = migrate(stored)
    assert migrated["parallel"] == {"sequence": 1, "tensor": 1, "expert": 2}
    assert "ep_size" not in migrated["moe"] and "tensor_parallel" not in migrated["cluster"]
    assert stored["moe"]["ep_size"] == 2  # the stored dict is left as it was
    assert load_config(None, base=stored).parallel.expert == 2  # a base is a stored config: migrated
    assert migrate({"parallel": {"expert": 4}, "moe": {"ep_size": 2}})["parallel"] == {"expert": 4}  # new key wins


def test_the_old_checkpoint_fixture_config_loads(tmp_path):
    from pretrain.checkpoint import reader

    old = FIXTURES / "old_checkpoint" / "step_00000002"
    assert "ep_size" in (old / "config.yaml").read_text()  # written before the parallel section
    ckpt = reader.find_checkpoint(shutil.copytree(old, tmp_path / "run" / old.name))
    assert "ep_size" not in reader.config_dict(ckpt).get("moe", {})
    cfg = reader.read_config(ckpt)
    assert (cfg.parallel.sequence, cfg.parallel.tensor, cfg.parallel.expert) == (1, 1, 1)
