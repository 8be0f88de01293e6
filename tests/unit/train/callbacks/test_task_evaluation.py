"""Downstream tasks in training (``pretrain/train/callbacks/task_evaluation.py``) under model parallelism: which
examples each worker scores, rows padded for sequence parallelism, and the scores of 2 sequence-parallel gloo ranks
(the session's processes of ``tests/harness.py``) against one process. The scores themselves are checked by hand in
``tests/unit/train/test_mlflow_records.py``."""

from __future__ import annotations

import torch

from pretrain.config import make_plan
from pretrain.data.tasks import Example, Task
from pretrain.model import build_model
from pretrain.train.callbacks.task_evaluation import padded_forward, prepare_tasks, task_part
from tests.harness import run_distributed, tiny_config

TASK = Task(
    "toy",
    [
        Example("the cat sat on the", [" mat", " a", " sofa"], 0),
        Example("one two three", [" four", " five!"], 1),
        Example("abc", [" x", " yz"], 1),
        Example("a rose is a", [" rose", " tulip", " pot"], 0),
        Example("red green", [" blue", " bluer"], 0),
    ],
)


class _CharTokenizer:
    """One token per character (id = code point mod 97 + 3); id 1 is the mask token."""

    mask_token_id = 1

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) % 97 + 3 for c in text]}


def test_the_workers_of_a_sequence_parallel_group_score_the_same_examples():
    """4 workers, sequence parallelism 2: workers 0 and 1 score examples 0, 2, 4, workers 2 and 3 examples 1, 3 (by
    data-parallel rank, not by global rank)."""
    plan = make_plan(tiny_config("parallel.sequence=2", "cluster.num_workers=4", "data.num_streams=2"), 4)
    parts = [task_part(plan, rank) for rank in range(4)]
    assert parts == [(0, 2), (0, 2), (1, 2), (1, 2)]
    answers = [prepare_tasks([TASK], _CharTokenizer(), "decoder", 16, *part)[0].answers for part in parts]
    assert answers == [[0, 1, 0], [0, 1, 0], [1, 0], [1, 0]]


def test_padded_rows_keep_a_decoders_logits():
    """Rows padded to a multiple of 4 tokens for sequence parallelism: a decoder's logits of the row are those
    without the padding (to float rounding: the matrix products have other shapes)."""
    model = build_model(tiny_config("model.dropout=0.0").model, 0).eval()
    ids = torch.randint(0, 101, (1, 7), generator=torch.Generator().manual_seed(0))
    seen = []

    def forward(i, labels):
        seen.append((i.shape[1], labels[0, 7:].tolist()))
        return model(i).logits

    with torch.no_grad():
        got = padded_forward(forward, 4)(ids, ids)
        torch.testing.assert_close(got, model(ids).logits, rtol=1e-5, atol=1e-6)
    assert seen == [(8, [-100])]
    assert padded_forward(forward, 1) is forward


def _scores(rank: int, world: int) -> tuple[dict, dict]:
    """The task metrics of a decoder under sequence parallelism on 2 workers (as ``TaskEvaluation`` runs them), and
    those of the same model in one process (counted once: by rank 0)."""
    from pretrain.train.callbacks.task_evaluation import task_metrics
    from pretrain.train.module import build_module

    torch.set_num_threads(1)
    cfg = tiny_config("model.dropout=0.0", "parallel.sequence=2", "cluster.num_workers=2", "train.precision=fp32")
    module = build_module(cfg)
    plan, engine, tok, cpu = module.plan, module.engine, _CharTokenizer(), torch.device("cpu")
    engine.eval()
    with torch.no_grad():
        got = task_metrics(
            padded_forward(lambda ids, labels: engine(ids, labels=labels).logits, plan.sequence_parallel),
            prepare_tasks([TASK], tok, "decoder", 16, *task_part(plan, rank)),
            "decoder",
            cpu,
            counted=plan.shares_data(rank),
        )
        model = build_model(cfg.model, cfg.train.seed).eval()
        want = task_metrics(
            lambda ids, labels: model(ids).logits, prepare_tasks([TASK], tok, "decoder", 16), "decoder", cpu, rank == 0
        )
    return got, want


def test_tasks_under_sequence_parallelism_score_as_one_process():
    """2 workers of one sequence-parallel group score the same examples (rows of odd lengths padded to even ones) and
    count them once: the metrics of one process."""
    ranks = run_distributed(_scores, 2, fresh=False)
    for got, want in ranks:
        assert got == want and set(got) == {"eval/toy/acc", "eval/toy/acc_norm"}, ranks
