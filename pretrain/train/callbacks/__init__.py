"""The trainer's callbacks, one concern per module. The contract — the :class:`Callback` base, every event and hook,
the ``order`` — is :mod:`pretrain.train.callbacks.base`; :mod:`pretrain.train.callbacks.standard` declares the set a
run uses (its docstring lists them in order)."""
