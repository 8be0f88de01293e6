"""``./launch.sh bench --checkpoint``: the raw write limit it measures, the per-rank hashing a run records for it
(``CheckpointStats``, the process-wide hash tally), the rows and targets it builds from the runs' summaries. One tiny
size end to end through the CLI (its runs as torchrun ranks) is in ``tests/integration/bench/test_checkpoint.py``."""

from __future__ import annotations

import os
import threading
from types import SimpleNamespace

import pytest

from benchmarks import checkpoint as bc
from pretrain.checkpoint import store
from pretrain.checkpoint.hash_tally import hash_tally, sha256_file
from tests.conftest import FIXTURES

OLD = FIXTURES / "old_checkpoint" / "step_00000002"


def test_raw_write_writes_and_fsyncs_exactly_the_bytes_then_removes_its_file(tmp_path, monkeypatch):
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.fstat(fd).st_size), real_fsync(fd))[1])
    nbytes = 5 * (1 << 20) + 3  # not a whole number of chunks
    seconds = bc.raw_write_seconds(tmp_path, nbytes, chunk=1 << 20)
    assert synced == [nbytes] and seconds > 0
    assert list(tmp_path.iterdir()) == []


def test_the_hash_tally_counts_every_byte_hashed_in_any_thread(tmp_path):
    sizes = [0, 1, (1 << 20) + 7, 3 << 20]
    for i, n in enumerate(sizes):
        (tmp_path / f"f{i}").write_bytes(os.urandom(n))
    before = hash_tally()
    worker = threading.Thread(target=lambda: [sha256_file(tmp_path / f"f{i}") for i in (2, 3)])
    worker.start()
    store.hash_files(tmp_path, [tmp_path / "f0", tmp_path / "f1"])
    worker.join()
    spent = hash_tally() - before
    assert spent.bytes == sum(sizes) and spent.seconds > 0


class _Tracker:
    def __init__(self) -> None:
        self.logged: list[tuple[dict, int]] = []

    def log_metrics(self, metrics: dict, step: int) -> None:
        self.logged.append((metrics, step))


def test_checkpoint_stats_report_resume_and_save_hashing_per_rank(tmp_path):
    """A world of one: what was hashed from worker setup to the loop is the resume's (here a full verification
    of a committed checkpoint: each byte once), what was hashed in the loop its saves' (in any thread, as an
    asynchronous save hashes), per save."""
    from pretrain.train.callbacks.checkpoint_stats import CheckpointStats

    trainer = SimpleNamespace(
        ctx=SimpleNamespace(is_main=True), tracker=_Tracker(), state=SimpleNamespace(step=2), last_checkpoint=OLD
    )
    stats = CheckpointStats(hash_tally())
    store.verify(OLD)  # the resume's verification
    stats.on_run_start(trainer)
    for save in range(2):
        (tmp_path / f"shard{save}").write_bytes(b"x" * 1000)
        stats.on_checkpoint(trainer, tmp_path / f"step_0000000{save}")  # not committed yet (asynchronous)
        worker = threading.Thread(target=store.hash_files, args=(tmp_path, [tmp_path / f"shard{save}"]))
        worker.start()
        worker.join()
    final: dict = {}
    stats.on_run_end(trainer, final)
    total = store.read_manifest(OLD).total_bytes
    assert final["resume_hash_bytes_per_rank"] == [total] and final["checkpoint_bytes"] == total
    assert final["checkpoint_hash_bytes_per_rank"] == [1000] and final["checkpoint_hash_s_per_rank"][0] > 0
    ((metrics, step),) = trainer.tracker.logged
    assert step == 2 and metrics["ckpt/bytes"] == total and metrics["resume/hash_bytes"] == total
    assert {"ckpt/hash_s_rank0", "resume/hash_s_rank0"} <= set(metrics)


def _summary(stalls: list[tuple[int, float]], step: int, nbytes: int = 2_000_000_000, **kw) -> dict:
    return {
        "step": step,
        "checkpoint_bytes": nbytes,
        "checkpoints": len(stalls),
        "checkpoint_saves": [{"step": n, "stall_s": s} for n, s in stalls],
        **kw,
    }


def test_rows_and_targets_from_the_runs_summaries():
    sync = _summary(
        [(5, 8.0), (10, 10.0), (15, 30.0)],
        15,
        checkpoint_hash_s_per_rank=[2.0, 2.0],
        checkpoint_hash_bytes_per_rank=[10, 20],
    )
    resume = {
        "time_to_first_step_s": 61.5,
        "resume_hash_bytes_per_rank": [1_500_000_000, 500_000_000],
        "resume_hash_s_per_rank": [3.0, 1.0],
    }
    saves = [
        {"step": n, "stall_s": st, "snapshot_s": st - 0.1, "commit_s": 0.1, "write_s": 5.0, "snapshot_gb": 1.0}
        for n, st in ((5, 0.5), (10, 0.9), (15, 9.0))
    ]  # the checkpointer's records (asynchronous saves)
    asyn = {"step": 15, "checkpoint_bytes": 2_000_000_000, "checkpoint_saves": saves, "checkpoint_snapshot_gb_max": 1.0}
    row = bc.size_row(1024, sync, resume, raw_write_s=4.0, asyn=asyn)
    assert row["sync_stall_s_each"] == [8.0, 10.0], "the final save (waited for at the run's end) is not timed"
    assert row["sync_stall_s"] == 9.0 and row["sync_save_vs_raw"] == 9.0 / 4.0 and row["sync_stall_s_per_gb"] == 4.5
    assert row["async_stall_s"] == pytest.approx(0.7) and row["async_stall_frac"] == pytest.approx(0.7 / 9.0)
    assert row["async_snapshot_s"] == pytest.approx(0.6) and row["async_write_s"] == 5.0
    assert row["async_snapshot_gb_max"] == 1.0
    assert row["hash_s_per_rank"] == [2.0, 2.0] and row["hash_bytes_per_rank"] == [10, 20]
    assert row["resume_hashes_each_byte_once"] and row["resume_time_to_first_step_s"] == 61.5
    before_records = {"step": 8, "checkpoint_bytes": 100, "checkpoints": 2, "checkpoint_seconds": 0.8}
    twice = bc.size_row(
        256,
        before_records,
        {"resume_hash_bytes_per_rank": [100, 100]},
        0.2,
        None,
        "checkpoint.async is not a config key here",
    )
    assert twice["sync_stall_s_each"] == [0.4, 0.4], "without per-save records: the mean loop time of a save"
    assert not twice["resume_hashes_each_byte_once"]
    assert twice["async_stall_s"] is None and "not a config key" in twice["async_unavailable"]
    t = bc.targets([twice, row])  # measured at the largest checkpoint
    assert t["largest_hidden"] == 1024 and t["async_stall_le_10pct_of_sync"] is True
    assert t["sync_save_le_1_5x_raw"] is False and t["resume_hashes_each_byte_once"] is False
    assert bc.targets([twice])["async_stall_le_10pct_of_sync"] is None  # not measured: neither met nor missed
    text = bc.table({"sizes": [twice, row], "async_unavailable": "", "targets": t})
    assert len(text.splitlines()) == 3 + len(t) and "n/a" in text.splitlines()[1]


def test_size_overrides_give_heads_of_64_and_one_stream_per_worker():
    from pretrain.config import load_config

    cfg = load_config(bc.DEFAULT_CONFIG, [*bc.RUN, *bc.size_overrides(1024, 8, 2, 2)])
    assert (cfg.model.hidden_size, cfg.model.num_layers, cfg.model.num_heads, cfg.model.num_kv_heads) == (
        1024,
        8,
        16,
        8,
    )
    assert (cfg.cluster.num_workers, cfg.data.num_streams, cfg.zero.stage) == (2, 2, 2)


def test_runs_of_several_workers_without_ray_are_launched_by_torchrun():
    """``cluster.use_ray=false`` with several workers: each run as that many ``torchrun`` ranks (the config's count,
    a user's override included); through Ray, or one worker: none."""
    config, no_ray = bc.DEFAULT_CONFIG, "cluster.use_ray=false"
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]
    assert bc.launcher(config, [no_ray, "cluster.num_workers=2"]) == [*torchrun, "2"]
    assert bc.launcher(config, ["cluster.num_workers=2", no_ray, "cluster.num_workers=3"]) == [*torchrun, "3"]
    assert bc.launcher(config, ["cluster.num_workers=2"]) == [] and bc.launcher(config, [no_ray]) == []
