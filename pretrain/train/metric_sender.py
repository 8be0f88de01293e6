"""Metrics to MLflow for the training loop: queued (MLflow's background thread writes them, the loop does not wait
on the store), waited for every :data:`PENDING_LIMIT` calls, and never the end of a run when the tracking store
refuses them for a while.

MLflow retries a refused write for about four minutes before the asynchronous write fails. Waiting on every queued
write through an outage would stall the loop for as long (several writes a step, a few at a time), and the other
ranks with it, in a collective whose timeout may end the run. So a write that fails, or has no answer within
:data:`WAIT_S`, puts the sender into a held state: from then on the loop's metrics are kept here (at most
:data:`HELD_LIMIT` values, the oldest dropped beyond and counted) and one small write at a time, in a thread of its
own, probes the store; when one succeeds, the held values are sent (with their own steps and times, so the
history is whole) and the sender goes back to queueing. One warning when the store starts refusing, one when it
takes the values again.
"""

from __future__ import annotations

import concurrent.futures
import sys
import threading
import time
from concurrent.futures import Future
from typing import Any

PENDING_LIMIT = 64
"""Queued writes after which the sender waits for them (a store slower than the loop is waited for)."""
WAIT_S = 60.0
"""How long one wait for the queued writes lasts before the store counts as not answering."""
HELD_LIMIT = 100_000
"""Metric values held while the store refuses them; beyond it the oldest are dropped (and counted)."""
CHUNK = 500
"""Metrics per request (MLflow takes at most 1000)."""
REFUSED_FOR_CONTENT = ("INVALID_PARAMETER_VALUE", "BAD_REQUEST")
"""MLflow error codes of a write the store answered and refused for what it holds: a probe refused so is dropped
(and counted), not held again (it would hold every later value)."""


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class MetricSender:
    """``log_batch`` of ``client`` for run ``run_id``; ``asynchronous=False`` writes each batch before returning
    (and a refused write raises: a command's own records, not the training loop's)."""

    def __init__(self, client: Any, run_id: str, asynchronous: bool):
        self.client, self.run_id, self.asynchronous = client, run_id, asynchronous
        self._pending: list[tuple[Any, list]] = []  # MLflow's futures of queued writes, and their metrics
        self._held: list = []  # while the store refuses: the metrics not in it, oldest first
        self._dropped = 0  # ... and those beyond HELD_LIMIT, lost
        self._probe: tuple[Future, list] | None = None  # one write in a thread of its own, and its metrics
        self.holding = False

    def log(self, batch: list) -> None:
        if self.holding:
            self._hold(batch)
            self._poll()
            return
        if len(self._pending) >= PENDING_LIMIT:
            self.flush()
            if self.holding:
                self._hold(batch)
                return
        self._send(batch)

    def _send(self, batch: list) -> None:
        for i in range(0, len(batch), CHUNK):
            chunk = batch[i : i + CHUNK]
            op = self.client.log_batch(self.run_id, metrics=chunk, synchronous=not self.asynchronous)
            if op is not None:
                self._pending.append((op, chunk))

    def flush(self, final: bool = False) -> None:
        """Wait for the queued writes (at most :data:`WAIT_S`); those refused or unanswered are held. While
        holding: look at the probe. ``final`` (the run's end): within the same :data:`WAIT_S`, probe until the store
        takes the held values, and wait for them."""
        deadline = time.monotonic() + WAIT_S
        if not self.holding:
            self._wait_pending(deadline)
        if not self.holding or not final:
            if self.holding:
                self._poll()
            return
        while self.holding and time.monotonic() < deadline:
            self._poll(wait=max(0.0, deadline - time.monotonic()))
        if not self.holding:
            self._wait_pending(deadline)

    def _wait_pending(self, deadline: float) -> None:
        pending, self._pending = self._pending, []
        failed, error = [], None
        for op, chunk in pending:
            e = _wait(op, deadline)
            if e is not None:
                failed.extend(chunk)
                error = error or e
        if error is None:
            return
        self.holding = True
        self._hold(failed)
        first = (str(error).strip().splitlines() or [""])[0][:300]
        _say(
            f"warning: MLflow did not take {len(failed):,} metric values ({first}); training goes on, the values are "
            "held and sent once the tracking store takes them"
        )

    def unsent(self) -> int:
        """Metric values not in the store (held, or dropped)."""
        return len(self._held) + (len(self._probe[1]) if self._probe else 0) + self._dropped

    def _hold(self, batch: list) -> None:
        self._held.extend(batch)
        over = len(self._held) - HELD_LIMIT
        if over > 0:
            self._dropped += over
            del self._held[:over]

    def _poll(self, wait: float = 0.0) -> None:
        """Start a probe (the oldest held chunk) if none runs; when it ends: failed, its chunk is held again (a new
        probe follows); succeeded, the held values are sent and the sender queues again."""
        if self._probe is None:
            if not self._held:
                self.holding = False
                return
            chunk, self._held = self._held[:CHUNK], self._held[CHUNK:]
            write = lambda c=chunk: self.client.log_batch(self.run_id, metrics=c, synchronous=True)  # noqa: E731
            self._probe = (_in_thread(write), chunk)
        future, chunk = self._probe
        concurrent.futures.wait([future], timeout=wait)
        if not future.done():
            return
        self._probe = None
        if (error := future.exception()) is not None:
            if getattr(error, "error_code", "") in REFUSED_FOR_CONTENT:  # the store answers, and refuses these
                self._dropped += len(chunk)
            else:  # no answer: held again, for the next probe
                self._held[:0] = chunk
            return
        held, self._held, self.holding = self._held, [], False
        lost = f"; {self._dropped:,} older ones were dropped" if self._dropped else ""
        sent = len(chunk) + len(held)
        _say(f"MLflow: the tracking store takes metrics again (the {sent:,} values held are sent{lost})")
        self._dropped = 0
        self._send(held)


def _wait(op: Any, deadline: float) -> BaseException | None:
    """Wait for one queued write until ``deadline``: None when it is in the store, else why not."""
    from mlflow.exceptions import MlflowException

    futures = getattr(op, "_operation_futures", None)  # MLflow's RunOperations: its concurrent futures
    if futures is not None:
        _, not_done = concurrent.futures.wait(futures, timeout=max(0.0, deadline - time.monotonic()))
        if not_done:
            return TimeoutError(f"no answer within {WAIT_S:.0f} s")
    try:
        op.wait()
    except MlflowException as e:
        return e
    return None


def _in_thread(fn) -> Future:
    """``fn()`` in a daemon thread (a process that ends while the store does not answer does not wait for it)."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - the caller reads it from the future
            future.set_exception(e)

    threading.Thread(target=run, daemon=True, name="mlflow-probe").start()
    return future
