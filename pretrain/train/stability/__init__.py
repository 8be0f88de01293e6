"""Training-stability control, in three parts:

* :mod:`pretrain.train.stability.monitor` — the functional core (:class:`StabilityMonitor`: detectors, the policy's
  decision, the event timeline; no tensors, files or process groups): the detectors and actions of
  ``stability.*``;
* :mod:`pretrain.train.stability.control` — the loop's thin impure shell (:class:`StabilityControl`: progress lines,
  MLflow, halts, rollbacks);
* :mod:`pretrain.train.callbacks.stability` — the callbacks that drive it: the guard of every update
  (``StabilityCallback``) and the report at the end of a run (``StabilityReport``).

The step hands the monitor the all-reduced signals (:class:`pretrain.train.stability.monitor.StepSignals`) through
the ``decide`` step hook (:mod:`pretrain.train.step`). Health probes are :mod:`pretrain.train.health`.
"""
