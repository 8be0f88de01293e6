"""The trainer's callbacks, one per module; :mod:`pretrain.train.callbacks.standard` assembles the set a run uses
(its docstring lists them in order). The base class and the events are in :mod:`pretrain.train.trainer`."""
