"""Ray only where Ray is used: what needs it is refused in one line (exit 2) where it is not installed."""

from __future__ import annotations

import sys

import pytest

from cluster.requires import RayMissingError, ray_installed, require_ray, require_ray_for
from pretrain.config import ClusterConfig
from pretrain.config.errors import user_error


def test_installed_ray_passes():
    assert ray_installed()
    require_ray("anything")
    require_ray_for(ClusterConfig(num_workers=2))


def test_missing_ray_is_one_line_naming_what_to_do(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed: import fails, find_spec finds nothing
    assert not ray_installed()
    with pytest.raises(RayMissingError) as e:
        require_ray("./launch.sh submit")
    assert user_error(e.value) == (2, str(e.value))
    assert str(e.value).startswith("./launch.sh submit runs on Ray, which is not installed")
    require_ray_for(ClusterConfig(num_workers=2, use_ray=False))  # trains in this process (or under torchrun)
    require_ray_for(ClusterConfig(num_workers=1))  # one worker, nothing for Ray to do
    for cluster in (ClusterConfig(num_workers=2), ClusterConfig(num_workers=1, max_failures=1)):
        with pytest.raises(RayMissingError, match=r"^cluster\.use_ray: .*set cluster\.use_ray=false"):
            require_ray_for(cluster)


def test_the_commands_that_run_ray_data_are_refused_in_one_line_without_it(monkeypatch, tmp_path, capsys):
    """``tokenize`` and ``bench --data`` tokenize with Ray Data (an embedded Ray by default, where no cluster is
    involved): without Ray each is one line, exit 2, before anything is read or written; ``--help`` still answers."""
    from pretrain.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)
    text = tmp_path / "t.txt"
    text.write_text("a line\n", encoding="utf-8")
    for argv, what in (
        (["tokenize", str(text), "--out", str(tmp_path / "shards")], "tokenize"),
        (["bench", "--data"], "bench --data"),
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"{what} runs on Ray, which is not installed" in err[0], err
    assert not (tmp_path / "shards").exists()
    assert main(["bench", "--data", "--help"]) == 0
