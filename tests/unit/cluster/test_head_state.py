"""What ``cluster up`` records and guards (``cluster/head_state.py``): a new token for each head, the lock that keeps
a second ``up`` or ``down`` off a head being changed, and the temp dir a head claims (never another Ray's)."""

from __future__ import annotations

import stat

import pytest

from cluster import head_state
from cluster.head_state import ClusterError, ClusterUsageError, claim_temp_dir, locked


def test_each_head_gets_a_new_token_readable_by_its_user_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("PRETRAIN_RAY_HEAD_DIR", str(tmp_path / "head"))
    first = head_state.new_token()
    token = first.read_text()
    assert len(token) == 64 and stat.S_IMODE(first.stat().st_mode) == 0o600
    second = head_state.new_token()
    assert second == first and second.read_text() != token and stat.S_IMODE(second.stat().st_mode) == 0o600
    assert sorted(p.name for p in first.parent.iterdir()) == [first.name]  # no temporary file left


def test_up_and_down_hold_the_state_directorys_lock(tmp_path, monkeypatch):
    monkeypatch.setenv("PRETRAIN_RAY_HEAD_DIR", str(tmp_path / "head"))
    with locked("up"):
        with pytest.raises(ClusterError, match=r"^cluster down: another cluster up or down is running for "):
            with locked("down"):
                pass
    with locked("down"):  # released
        pass


def test_a_temp_dir_given_must_be_new_empty_or_a_heads_of_this_state_directory(tmp_path, monkeypatch):
    """``down`` ends what works in the head's temp dir: another Ray's (``--temp-dir /tmp/ray``) is refused."""
    monkeypatch.setenv("PRETRAIN_RAY_HEAD_DIR", str(tmp_path / "head"))
    new, empty, other = tmp_path / "new", tmp_path / "empty", tmp_path / "other"
    empty.mkdir()
    (other / "session_latest").mkdir(parents=True)
    for d in (new, empty):
        claim_temp_dir(d)
        assert stat.S_IMODE(d.stat().st_mode) == 0o700 and (d / head_state.TEMP_DIR_MARK).is_file()
        (d / "session_latest").mkdir()
        claim_temp_dir(d)  # a head of this state directory made it: claimed again
    with pytest.raises(ClusterUsageError, match=r"--temp-dir .*/other: not empty, and not the temp dir of a head"):
        claim_temp_dir(other)
    assert not (other / head_state.TEMP_DIR_MARK).exists()  # nothing written into it
    claim_temp_dir(other, recorded=str(other))  # the temp dir an earlier head's state names (made before marks)
    assert (other / head_state.TEMP_DIR_MARK).is_file()
    (other / head_state.TEMP_DIR_MARK).unlink()
    claim_temp_dir(other, given=False)  # the default temp dir, named after the state directory: its own
    monkeypatch.setenv("PRETRAIN_RAY_HEAD_DIR", str(tmp_path / "another-checkout"))
    with pytest.raises(ClusterUsageError, match="not the temp dir of a head started here"):
        claim_temp_dir(new)
