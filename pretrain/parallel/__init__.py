"""Parallelism, in one package: the layout and its rules below the config, and how each parallelism is applied to
the single-device model above it.

* ``dims.py``: :class:`~pretrain.parallel.dims.ParallelDims`, the degrees (data, ZeRO sharding, sequence, tensor,
  expert), the rank mapping and the process groups, built once from the config (``RunPlan.dims``).
* ``rules.py``: what composes (divisibility, ZeRO stages, MoE, compiled blocks), checked at config load.
* ``sequence.py`` (DeepSpeed Ulysses), ``tensor.py`` (DeepSpeed AutoTP), ``expert.py`` (expert parallelism): one
  module per parallelism, how it is applied to a model, its DeepSpeed config section, gather/split of its shards.
* ``collectives.py``: collectives on host tensors, run on the process group's device (NCCL takes CUDA tensors only).
* ``apply.py``: :func:`~pretrain.parallel.apply.parallelize`, the one entry point ``build_module`` calls.

This ``__init__`` imports nothing: ``pretrain.config`` imports ``dims`` and ``rules`` (pure, no torch), while the
per-parallelism modules import the model and ``pretrain.ds_adapter`` (DeepSpeed is reached only through it).
See "Adding a parallelism" in docs/architecture.md.
"""
