"""Held-out evaluation of a checkpoint (run id, run dir, checkpoint dir) or a Hugging Face directory.

    ./launch.sh eval RUN_ID_OR_CHECKPOINT_OR_HF_DIR [--data PATH ...] [--step N] [--sequences N]
                     [--seq-len N] [--batch-size N] [--tasks TASKS] [--harness TASKS] [--max-examples N]
                     [--num-choices N] [--no-sample] [--json]

What is evaluated and its defaults: :mod:`eval.sources`.

The data is the validation set of the run (its ``val_sources`` or its hash holdout; the same packed
sequences and MLM masks as training's validation, see :func:`pretrain.data.validation_batches`), or
``--data PATH ...`` (files/globs/dirs, or ``demo``). An exported directory carries its run's data
config (``pretrain_export.json``), so a checkpoint and its export are scored on identical ids; for
any other HF directory ``--data`` is required.

Metrics (the one scorer, ``pretrain/model/score.py``, which training's validation and growth's check use too:
each batch's fp32 mean cross-entropy weighted by its predicted tokens, summed in float64):

* decoders -- ``loss``: mean next-token cross-entropy in nats over the predicted tokens (positions
  1..T-1 of every packed sequence, separators included); ``ppl = exp(loss)`` (the loss capped at 50 nats);
  ``bits_per_byte``:
  ``sum of those nats / (ln 2 * B)`` where ``B`` is the number of UTF-8 bytes of the text those
  predicted tokens spell (a token's bytes; special tokens such as the document separator spell 0
  bytes). It does not depend on the tokenizer's vocabulary: it prices the text, not the tokens. Exact
  for byte-level BPE (this project's tokenizers); for other tokenizers a token's bytes are those of
  its individual decoding.
* encoders -- ``loss``: mean cross-entropy over the masked (selected) positions; ``ppl = exp(loss)``;
  ``mlm_acc``: fraction of those positions whose argmax is the original token.

Results print as a table, or with ``--json`` as one JSON object (keys ``loss``, ``ppl``,
``bits_per_byte`` or ``mlm_acc``, plus counts and provenance). For a tracked run/checkpoint they are
logged to its MLflow run as ``eval/...`` metrics at the checkpoint's step (and ``eval/step_NNNNNNNN.json``); with
``--data``, as ``eval/<name>/...`` (the sources' names, ``+``-joined), never over the run's own.
Decoders also get a short greedy sample from ``transformers``' ``generate`` (skipped, with a note, for a model that no
Hugging Face class represents; see :func:`pretrain.export.hf.unexportable`).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Callable
from typing import Any

import torch

from eval.sources import EvalSource, data_config, open_source
from pretrain.config import ConfigError
from pretrain.config.errors import ArgumentParser
from pretrain.data.token_bytes import token_byte_lengths
from pretrain.model.score import NoTokensError, score_batches

DEFAULT_SEQUENCES = 64
"""Sequences scored when neither ``--sequences`` nor the run says (a run with ``train.val_sequences: 0``)."""

# ----------------------------------------------------------------------------------------------
# Scoring (the functional core: logits function + batches -> metrics)
# ----------------------------------------------------------------------------------------------


def score(
    logits_fn: Callable[[torch.Tensor], torch.Tensor],
    batches: list[dict[str, torch.Tensor]],
    kind: str,
    byte_lengths: torch.Tensor | None = None,
) -> dict[str, float]:
    """Metrics of the module docstring over ``batches`` ({"input_ids", "labels"}, labels -100 = ignore): the one
    scorer (``pretrain/model/score.py``, as training's validation and growth's check), plus the counts."""
    sums = score_batches(lambda ids, labels: logits_fn(ids), batches, kind, byte_lengths)
    out: dict[str, Any] = {**sums.metrics(kind, with_bytes=True), "tokens": int(sums.tokens)}
    if kind == "decoder":
        out["bytes"] = int(sums.bytes)
    return out


# ----------------------------------------------------------------------------------------------
# Sample, harness, tracking
# ----------------------------------------------------------------------------------------------


@torch.no_grad()
def greedy_sample(hf_model, tokenizer, prompt_ids: list[int], max_len: int, new_tokens: int = 24) -> dict[str, str]:
    """Greedy continuation of ``prompt_ids`` with ``transformers`` ``generate``."""
    n = max(0, min(new_tokens, max_len - len(prompt_ids)))
    ids = torch.tensor([prompt_ids])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = hf_model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=pad
    )
    return {
        "prompt": tokenizer.decode(prompt_ids),
        "continuation": tokenizer.decode(out[0, len(prompt_ids) :].tolist()),
    }


def run_harness(src: EvalSource, tasks: str) -> tuple[str, dict | None]:
    """lm-evaluation-harness on the model's HF directory when ``lm_eval`` and the task data are available
    locally; otherwise one line saying why not. Returns (line, per-task results or None)."""
    if src.no_hf:
        return f"harness: {src.no_hf} has no Hugging Face class; skipped tasks {tasks}", None
    if src.kind != "decoder":  # lm_eval's "hf" model is AutoModelForCausalLM: a BERT export loads as BertLMHeadModel
        why = f"{src.label} is a masked LM; lm-evaluation-harness scores causal LMs"
        return f"harness: {why}; skipped tasks {tasks}", None
    if importlib.util.find_spec("lm_eval") is None:
        return f"harness: lm-evaluation-harness (package lm_eval) is not installed; skipped tasks {tasks}", None
    try:
        import lm_eval

        from pretrain.export.hf import is_our_remote_code

        with src.hf_dir() as path:
            if "," in str(path) or "=" in str(path):  # lm_eval splits model_args at each ',' (some versions at '=')
                return f"harness: {path}: lm_eval's model_args cannot carry ',' or '=' in a path; skipped {tasks}", None
            args = f"pretrained={path},dtype=float32,trust_remote_code={is_our_remote_code(path)}"
            out = lm_eval.simple_evaluate(
                model="hf",
                model_args=args,
                tasks=[t for t in tasks.split(",") if t],
                device="cuda" if torch.cuda.is_available() else "cpu",
            )
        results = (out or {}).get("results", {})
        summary = "; ".join(
            f"{task}: " + ", ".join(f"{k} {v:.4f}" for k, v in m.items() if isinstance(v, float))
            for task, m in results.items()
        )
        return f"harness: {summary or 'no results'}", results
    except Exception as e:  # noqa: BLE001 - typically task data not available offline
        first = (str(e).strip().splitlines() or [""])[0]
        return f"harness: lm_eval could not run {tasks} ({type(e).__name__}: {first[:200]})", None


def metric_prefix(data: list[str] | tuple[str, ...] = ()) -> str:
    """``eval/`` for the run's own validation data; ``eval/<name>/`` for ``--data`` (its sources' names, as
    per-source validation names them, ``+``-joined), so that other data never overwrites the run's figures."""
    from pretrain.config import source_name

    return f"eval/{'+'.join(source_name(p) for p in data)}/" if data else "eval/"


def log_to_mlflow(run_id: str, step: int, result: dict[str, Any], data: list[str] | tuple[str, ...] = ()) -> None:
    """``<prefix><metric>`` at ``step`` (:func:`metric_prefix`)."""
    from pretrain.train.tracking import Tracker, tracking_uri

    tracker = Tracker(tracking_uri(), run_id)
    prefix = metric_prefix(data)
    metrics = {f"{prefix}{k}": float(result[k]) for k in ("loss", "ppl", "bits_per_byte", "mlm_acc") if k in result}
    tracker.log_metrics(metrics, step)
    tracker.log_json(result, f"{prefix}step_{step:08d}.json")


# ----------------------------------------------------------------------------------------------
# Entry points
# ----------------------------------------------------------------------------------------------


def evaluate(target: str, *, step: int | None = None, **kwargs) -> dict[str, Any]:
    """Evaluate ``target`` (see the module docstring) and return the result dict."""
    return evaluate_source(open_source(target, step), **kwargs)


def evaluate_source(
    src: EvalSource,
    *,
    data: list[str] | tuple[str, ...] = (),
    sequences: int | None = None,
    seq_len: int | None = None,
    batch_size: int = 8,
    sample: bool = True,
    track: bool = True,
) -> dict[str, Any]:
    """Score ``src`` on its (or ``data``'s) validation sequences; log to MLflow when tracked."""
    from pretrain.data import validation_batches

    if batch_size <= 0:
        raise ConfigError(f"--batch-size must be > 0, got {batch_size}")
    if sequences is not None and sequences <= 0:
        raise ConfigError(f"--sequences must be > 0, got {sequences}")
    if seq_len is not None and not 2 <= seq_len <= src.context:
        raise ConfigError(f"--seq-len must be from 2 to the model's context, {src.context}; got {seq_len}")
    dcfg = data_config(src, list(data))
    if data:
        _check_shards_vocabulary(dcfg, src)
    T = src.seq_len if seq_len is None else seq_len
    n = (src.val_sequences or DEFAULT_SEQUENCES) if sequences is None else sequences  # 0: a run without validation
    if dcfg.val_holdout <= 0 and not dcfg.val_sources:
        raise ConfigError(f"{src.label}: the run has no validation data (val_holdout 0); pass --data PATH")
    batches = validation_batches(
        dcfg, kind=src.kind, seq_len=T, tokenizer=src.tokenizer, val_sequences=n, micro_batch=batch_size, seed=src.seed
    )
    byte_lengths = token_byte_lengths(src.tokenizer, src.vocab_size) if src.kind == "decoder" else None
    try:
        metrics = score(src.logits_fn, batches, src.kind, byte_lengths)
    except NoTokensError as e:  # e.g. an encoder's few short sequences with no position masked
        raise ConfigError(f"{src.label}: {e}; score more or longer sequences (--sequences, --seq-len)") from None
    result: dict[str, Any] = {
        **metrics,
        "kind": src.kind,
        "source": src.label,
        "sequences": sum(len(b["input_ids"]) for b in batches),
        "seq_len": T,
        "data": [s.path for s in dcfg.val_sources] or f"holdout {dcfg.val_holdout:g} of training data",
        **src.info,
    }
    if src.step is not None:
        result["step"] = src.step
    if sample and src.kind == "decoder" and batches and src.no_hf:
        result["sample_skipped"] = f"{src.no_hf} has no Hugging Face class, which transformers' generate needs"
    elif sample and src.kind == "decoder" and batches:
        prompt = batches[0]["input_ids"][0, : max(1, min(8, T // 2))].tolist()
        result["sample"] = greedy_sample(src.hf_model(), src.tokenizer, prompt, T)
    if track and src.run_id and src.step is not None:
        log_to_mlflow(src.run_id, src.step, result, data)
        result["mlflow_run_id"] = src.run_id
    return result


def _check_shards_vocabulary(dcfg, src: EvalSource) -> None:
    """Token shards given with ``--data`` hold ids of the tokenizer they were made with: one of another vocabulary
    size than the model's is refused in one line (scored, its ids would mean other tokens, or none)."""
    from pretrain.data.shards.compat import shard_dirs
    from pretrain.data.shards.format import load_manifest

    for _, d in shard_dirs(dcfg):
        made, have = load_manifest(d).tokenizer.get("vocab_size"), len(src.tokenizer)
        if made is not None and int(made) != have:
            raise ConfigError(
                f"--data {d}: token shards of a tokenizer of {int(made):,} tokens; {src.label} has {have:,} "
                f"(tokenize the text with its tokenizer: ./launch.sh tokenize ... --tokenizer DIR)"
            )


def evaluate_tasks(
    src: EvalSource,
    specs: list[str],
    *,
    data: list[str] | tuple[str, ...] = (),
    max_examples: int | None = None,
    num_choices: int | None = None,
    track: bool = True,
) -> dict[str, float]:
    """``eval/<task>/acc`` (``acc_norm``) of ``src`` on ``specs`` (task files or ``heldout_lastword``, built from
    the run's held-out text, or from ``data``): the code training runs for ``eval.tasks``, in one process, with the
    run's ``eval.max_examples`` and ``eval.num_choices`` unless given. Logged to a tracked run under
    :func:`metric_prefix` (``eval/<name>/<task>/acc`` with ``data``)."""
    max_examples = src.tasks["max_examples"] if max_examples is None else max_examples
    num_choices = src.tasks["num_choices"] if num_choices is None else num_choices
    from pretrain.config import EvalConfig
    from pretrain.data.tasks import load_tasks
    from pretrain.train.callbacks.task_evaluation import prepare_tasks, task_metrics

    dcfg = data_config(src, list(data))
    if data:
        _check_shards_vocabulary(dcfg, src)
    given = EvalConfig(tasks=specs, max_examples=max_examples, num_choices=num_choices)
    given.validate(bool(dcfg.val_sources) or dcfg.val_holdout > 0)
    given.check_files()  # (a FIFO is named, never opened)
    tasks = load_tasks(specs, dcfg, max_examples=max_examples, num_choices=num_choices, seed=src.seed)
    metrics = task_metrics(
        lambda ids, labels: src.logits_fn(ids),
        prepare_tasks(tasks, src.tokenizer, src.kind, src.seq_len),
        src.kind,
        torch.device("cpu"),
    )
    if track and src.run_id and src.step is not None:
        from pretrain.train.tracking import Tracker, tracking_uri

        prefix = metric_prefix(data)
        logged = {prefix + k.removeprefix("eval/"): v for k, v in metrics.items()}
        Tracker(tracking_uri(), src.run_id).log_metrics(logged, src.step)
    return metrics


def print_table(r: dict[str, Any]) -> None:
    print(f"eval: {r['source']}")
    print(
        f"  data: {r['data']}; {r['sequences']} sequences x {r['seq_len']} tokens, {r['tokens']:,} predicted tokens"
        + (f", {r['bytes']:,} bytes" if "bytes" in r else "")
    )
    rows = [("loss", f"{r['loss']:.4f}"), ("perplexity", f"{r['ppl']:.3f}")]
    if "bits_per_byte" in r:
        rows.append(("bits per byte", f"{r['bits_per_byte']:.4f}"))
    if "mlm_acc" in r:
        rows.append(("MLM accuracy", f"{r['mlm_acc']:.4f}"))
    for k, v in rows:
        print(f"  {k:<14} {v}")
    if "sample" in r:
        s = r["sample"]
        print(f"  {'greedy sample':<14} {s['prompt']!r} -> {s['continuation']!r}")
    if "sample_skipped" in r:
        print(f"  {'greedy sample':<14} skipped: {r['sample_skipped']}")
    for k, v in r.get("tasks", {}).items():
        print(f"  {k[len('eval/') :]:<14} {v:.4f}")
    if "mlflow_run_id" in r:
        print(f"  logged eval/* metrics to MLflow run {r['mlflow_run_id']} at step {r['step']}")


def main(argv: list[str]) -> int:
    p = ArgumentParser(
        prog="launch.sh eval",
        description="Held-out loss/perplexity/bits-per-byte (decoders) or MLM "
        "accuracy (encoders) of a checkpoint or a Hugging Face directory.",
    )
    p.add_argument("source", help="MLflow run id, run dir, checkpoint dir, or Hugging Face model dir")
    p.add_argument(
        "--data",
        nargs="+",
        action="extend",
        default=[],
        metavar="PATH",
        help="evaluate on these sources instead of the run's validation data",
    )
    p.add_argument("--step", type=int, default=None, help="checkpoint step of a run (default: latest)")
    p.add_argument("--sequences", type=int, default=None, help="number of packed sequences (default: the run's)")
    p.add_argument("--seq-len", type=int, default=None, help="sequence length (default: the model's)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--harness", default=None, metavar="TASKS", help="lm-evaluation-harness tasks (comma-separated)")
    p.add_argument(
        "--tasks",
        default=None,
        metavar="TASKS",
        help="downstream tasks, comma-separated: JSONL task files (docs/tasks.md) and/or heldout_lastword",
    )
    p.add_argument("--max-examples", type=int, help="examples per task (default: the run's eval.max_examples, or 200)")
    p.add_argument("--num-choices", type=int, help="heldout_lastword's choices (default: the run's, or 4)")
    p.add_argument("--no-sample", action="store_true", help="skip the greedy sample")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    a = p.parse_args(argv)
    src = open_source(a.source, a.step)
    result = evaluate_source(
        src, data=a.data, sequences=a.sequences, seq_len=a.seq_len, batch_size=a.batch_size, sample=not a.no_sample
    )
    if a.tasks:
        result["tasks"] = evaluate_tasks(
            src,
            [t.strip() for t in a.tasks.split(",") if t.strip()],
            data=a.data,
            max_examples=a.max_examples,
            num_choices=a.num_choices,
        )
    line = None
    if a.harness:
        line, tasks = run_harness(src, a.harness)
        result["harness"] = tasks if tasks is not None else line
    if a.json:
        print(json.dumps(result, sort_keys=True, default=str))
        if line:
            print(line, file=sys.stderr)  # stdout stays one JSON object
    else:
        print_table(result)
        if line:
            print(line)
    return 0
