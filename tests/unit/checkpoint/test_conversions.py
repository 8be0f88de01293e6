"""Conversions cached in a run directory (``pretrain/checkpoint/conversions.py``): published only once their files
are on disk, and removed at a job's start once the checkpoint they were made from is gone (pruned, replaced by
another checkpoint of its step, or named without a key by an older version); nothing else is touched."""

from __future__ import annotations

from pretrain.checkpoint import conversions
from pretrain.checkpoint import layout as ly
from tests.unit.checkpoint.test_weights import _commit


def test_conversions_of_checkpoints_that_are_gone_are_removed_and_nothing_else(tmp_path):
    run = tmp_path / "run"
    five, seven = _commit(run, 5, tokens_seen=50), _commit(run, 7, tokens_seen=70)
    live = [
        ly.universal_dir(run, 5, conversions.manifest_key(five)),
        ly.resharded_dir(run, 7, conversions.manifest_key(seven)),
    ]
    stale = [
        ly.universal_dir(run, 5, "0123456789ab"),  # of an earlier checkpoint of step 5 (rolled back, trained again)
        ly.resharded_dir(run, 3, "0123456789ab"),  # of a pruned checkpoint
        run / f"{ly.UNIVERSAL_PREFIX}{ly.step_dir_name(7)}",  # named without a key
    ]
    elsewhere = _commit(tmp_path / "other-run", 9, tokens_seen=90)  # checkpoint.resume_from: another run's
    live.append(ly.universal_dir(run, 9, conversions.manifest_key(elsewhere)))
    others = [run / "universal-notes", run / "my-full-step_00000003-x"]  # not ours
    for d in live + stale + others:
        d.mkdir(parents=True)
        (d / "f").write_text("x")
    gone = conversions.remove_stale(run, keep=elsewhere)
    assert gone == sorted(d.name for d in stale)
    assert all(d.is_dir() for d in live + others) and not any(d.exists() for d in stale)
    assert not any(p.name.startswith(ly.LEFTOVER_PREFIXES) for p in run.iterdir())  # renamed, then deleted
    assert conversions.remove_stale(run) == [live[-1].name]  # without its checkpoint: removed too
    assert conversions.remove_stale(tmp_path / "none") == []


def test_a_conversion_is_published_after_its_files_are_on_disk(tmp_path, monkeypatch):
    synced = []
    monkeypatch.setattr(conversions, "fsync_file", lambda p: synced.append(p.relative_to(stage)))
    stage, final = tmp_path / ".tmp-universal-x", tmp_path / "universal-step_00000001-k"
    (stage / "state" / "zero").mkdir(parents=True)
    for rel in ("state/a.pt", "state/zero/b.pt", "top.json"):
        (stage / rel).write_text(rel)
    assert conversions.publish(stage, final) == final
    assert {str(p) for p in synced} == {"state/a.pt", "state/zero/b.pt", "top.json"}
    assert (final / "state" / "zero" / "b.pt").read_text() == "state/zero/b.pt" and not stage.exists()
