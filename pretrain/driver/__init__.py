"""The driver side of a command: run preparation (paths, tokenizer, MLflow run, preflight checks), the dry run,
the quiet console, and derived runs (prune, grow, anneal). Ray code is in ``cluster/``; this package hands it a
prepared job."""
