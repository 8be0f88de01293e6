"""A user error in a worker ends the run at once; every other failure is left to Ray Train's own policy, which
restarts the worker group up to ``cluster.max_failures`` times."""

from __future__ import annotations

import traceback

import torch.utils.checkpoint
from ray.train import FailureConfig
from ray.train.v2._internal.exceptions import UserExceptionWithTraceback
from ray.train.v2._internal.execution.failure_handling import FailureDecision, create_failure_policy
from ray.train.v2.api.exceptions import WorkerGroupError

from cluster.failures import UserErrorsEndTheRun, is_final
from pretrain.checkpoint.store import BadCheckpoint, CheckpointError
from pretrain.config import ConfigError
from pretrain.data.bad_records import BadRecordError
from pretrain.train.callbacks.growth import GrowthCheckError
from pretrain.train.checkpointer import NonFiniteWeightsError


def _failed(*errors: BaseException) -> WorkerGroupError:
    """A worker group's failure as Ray Train's controller receives it: each rank's error wrapped with its
    traceback text."""
    wrapped = {}
    for rank, e in enumerate(errors):
        text = "".join(traceback.format_exception(e))
        wrapped[rank] = UserExceptionWithTraceback(e, traceback_str=text)
    return WorkerGroupError("\n".join(str(w) for w in wrapped.values()), wrapped)


def test_user_errors_are_final_and_the_rest_is_ray_trains_to_retry():
    policy = UserErrorsEndTheRun(create_failure_policy(FailureConfig(max_failures=2)))
    final = (
        ConfigError("train.lr: must be > 0"),
        BadRecordError("a.jsonl:3: not JSON"),
        BadCheckpoint("/ckpt/step_00000004: checksum mismatch for data/rank_0.json"),
        GrowthCheckError("growth at step 4 changed the held-back loss by 0.3"),
        BadCheckpoint("/ckpt/step_00000004: converting its engine state to full weights ... needs a ZeRO-1/2"),
    )
    for error in final:
        assert is_final(_failed(error)), error
        assert policy.make_decision(_failed(error)) is FailureDecision.RAISE
    # one rank's user error decides, whatever the other ranks' collateral failures (a peer gone mid-collective)
    assert policy.make_decision(_failed(RuntimeError("Connection closed by peer"), final[0])) is FailureDecision.RAISE
    # a crash, an I/O error saving or reading a checkpoint, non-finite weights, another library's CheckpointError:
    # retried while max_failures allows
    for error in (
        RuntimeError("CUDA error: an illegal memory access"),
        CheckpointError("checkpoint at step 10 failed: rank 1: OSError: [Errno 116] Stale file handle"),
        CheckpointError("/ckpt/step_00000004: cannot read ds/state/model.pt (Input/output error)"),
        NonFiniteWeightsError("nan in weights"),
        torch.utils.checkpoint.CheckpointError("torch.utils.checkpoint: a different number of tensors was saved"),
    ):
        assert not is_final(_failed(error)), error
    crashes = [policy.make_decision(_failed(RuntimeError("boom"))) for _ in range(3)]
    assert crashes == [FailureDecision.RETRY, FailureDecision.RETRY, FailureDecision.RAISE]


def test_a_user_error_known_only_by_its_text_is_final():
    """A worker's error whose class the controller cannot unpickle reaches it as text only."""
    text = "Traceback (most recent call last):\n  ...\npretrain.config.errors.ConfigError: data.seq_len: too long\n"
    failure = WorkerGroupError(text, {0: UserExceptionWithTraceback(RuntimeError("unpicklable"), text)})
    assert is_final(failure)
    # only our classes, by their qualified names: not a message that quotes one, nor another library's
    for other in ("deepspeed.runtime.config.DeepSpeedConfigError: bad", "RuntimeError: ConfigError: in a message"):
        assert not is_final(WorkerGroupError(other, {0: UserExceptionWithTraceback(RuntimeError("x"), other)}))
