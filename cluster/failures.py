"""Which worker failures Ray Train restarts from the last checkpoint (``cluster.max_failures``), and which end the
run at once.

Ray Train restarts the worker group after any worker error, up to ``max_failures`` times. A restart is what a
crash, an out-of-memory kill or a lost node needs; it cannot help a user error: a config a worker refuses, a
malformed corpus record under ``data.bad_records=fail``, a checkpoint that does not verify. Each of those fails
the same way on every attempt, and each attempt starts the workers and resumes the run again before the user
sees the one line that says what to fix. :class:`UserErrorsEndTheRun` raises those at the first failure and
leaves every other decision to Ray Train's own policy. This module imports Ray Train's internals: the controller
process imports it to unpickle the policy.
"""

from __future__ import annotations

from ray.train.v2._internal.execution.failure_handling import FailureDecision, FailurePolicy
from ray.train.v2.api.exceptions import TrainingFailedError, WorkerGroupError

from pretrain.config.errors import user_error

FINAL_EXIT_CODE = 2
"""The exit code (:data:`pretrain.config.errors.EXIT_CODES`) of the errors no restart can help: the config, the
data or a checkpoint is wrong."""


def is_final(error: TrainingFailedError) -> bool:
    """Whether ``error`` is a worker group's failure in which some worker raised a user error that fails the same
    way on every attempt (exit code :data:`FINAL_EXIT_CODE`)."""
    if not isinstance(error, WorkerGroupError):
        return False
    return any(
        (known := user_error(failure)) is not None and known[0] == FINAL_EXIT_CODE
        for failure in error.worker_failures.values()
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
