"""Which worker failures Ray Train restarts from the last checkpoint (``cluster.max_failures``), and which end the
run at once.

Ray Train restarts the worker group after any worker error, up to ``max_failures`` times. A restart is what a
crash, an out-of-memory kill, a lost node or an I/O error needs; it cannot help a user error: a config a worker
refuses, a malformed corpus record under ``data.bad_records=fail``, a checkpoint that does not verify
(:data:`FINAL`). Each of those fails the same way on every attempt, and each attempt starts the workers and resumes
the run again before the user sees the one line that says what to fix. :class:`UserErrorsEndTheRun` raises those
at the first failure and leaves every other decision to Ray Train's own policy. This module imports Ray Train's
internals: the controller process imports it to unpickle the policy.
"""

from __future__ import annotations

from ray.train.v2._internal.execution.failure_handling import FailureDecision, FailurePolicy
from ray.train.v2.api.exceptions import TrainingFailedError, WorkerGroupError

from pretrain.config.errors import known_error

FINAL = frozenset({"ConfigError", "BadRecordError", "BadCheckpoint", "CheckpointNotWritable", "GrowthCheckError"})
"""The errors (:data:`pretrain.config.errors.EXIT_CODES`) that every attempt would raise again: a config a worker
refuses, a malformed record under ``data.bad_records=fail``, a checkpoint that is not what its manifest records,
a growth that fails its function-preservation check, a save where the disk or quota is full, the filesystem
read-only or the directory not writable. Another I/O error while saving or reading a checkpoint (a plain
``CheckpointError``), a crash, or non-finite weights are retried."""


def is_final(error: TrainingFailedError) -> bool:
    """Whether ``error`` is a worker group's failure in which some worker raised one of :data:`FINAL`."""
    if not isinstance(error, WorkerGroupError):
        return False
    return any(
        (known := known_error(failure)) is not None and known[0] in FINAL for failure in error.worker_failures.values()
    )


class UserErrorsEndTheRun(FailurePolicy):
    """Ray Train's failure policy (``inner``), except that a user error (:func:`is_final`) is raised at once."""

    def __init__(self, inner: FailurePolicy) -> None:
        super().__init__(inner.failure_config)
        self.inner = inner

    def make_decision(self, training_failed_error: TrainingFailedError) -> FailureDecision:
        if is_final(training_failed_error):
            return FailureDecision.RAISE
        return self.inner.make_decision(training_failed_error)
