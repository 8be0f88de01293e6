"""The ``eval`` section: downstream tasks evaluated inside training (see pretrain/data/tasks.py, docs/tasks.md)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from pretrain.config.errors import ConfigError, not_a, quote

BUILTIN_TASK = "heldout_lastword"


@dataclass(kw_only=True)
class EvalConfig:
    tasks: list[str] = field(default_factory=list)
    """Downstream tasks evaluated every ``eval.every`` steps on all ranks and logged as ``eval/<task>/acc`` (and
    ``acc_norm`` for multiple-choice): paths of local JSONL task files (docs/tasks.md; the task's name is the
    file stem) and/or ``heldout_lastword`` (built from the run's held-out text: no download)."""
    every: int = 0
    """Evaluate the tasks every this many steps (and at the last step); 0: every ``train.val_every`` steps
    (not at the FLOPs points of ``train.val_every_flops``; with neither, at the last step only)."""
    max_examples: int = 200
    """Examples per task (the first ones of a file; the built-in task builds this many)."""
    num_choices: int = 4
    """Choices per example of the built-in ``heldout_lastword`` task (the true word and distractors)."""

    def validate(self, has_heldout: bool) -> None:
        if self.every < 0:
            raise ConfigError(f"eval.every: must be >= 0, got {self.every}")
        if self.max_examples <= 0:
            raise ConfigError(f"eval.max_examples: must be > 0, got {self.max_examples}")
        if self.num_choices < 2:
            raise ConfigError(f"eval.num_choices: must be >= 2, got {self.num_choices}")
        names: set[str] = set()
        for i, spec in enumerate(self.tasks):
            if spec == BUILTIN_TASK:
                if not has_heldout:
                    raise ConfigError(
                        f"eval.tasks[{i}]: {BUILTIN_TASK} needs held-out text: set data.val_holdout "
                        f"> 0 or data.val_sources"
                    )
                name = spec
            else:
                path = Path(os.path.expanduser(spec))  # (an unknown ~user stays as written: no such file)
                if path.suffix != ".jsonl":
                    raise ConfigError(
                        f"eval.tasks[{i}]: {quote(spec)} is neither {BUILTIN_TASK} nor an existing .jsonl task file"
                    )
                name = path.stem
            if name in names:
                raise ConfigError(f"eval.tasks[{i}]: a second task named {quote(name)}")
            names.add(name)

    def check_files(self) -> None:
        """Every task file exists and is a regular file (a config that will evaluate them: not of a stored config
        only read, whose run may have ended long after its task files were moved)."""
        for i, spec in enumerate(self.tasks):
            if spec == BUILTIN_TASK:
                continue
            path = Path(os.path.expanduser(spec))
            if not_a(path):  # a FIFO, a directory: what it is, not "no such file"
                raise ConfigError(f"eval.tasks[{i}]: {quote(spec)} {not_a(path)}")
            if not os.path.isfile(path):  # (Path.is_file raises on a too long name)
                raise ConfigError(
                    f"eval.tasks[{i}]: {quote(spec)} is neither {BUILTIN_TASK} nor an existing .jsonl task file"
                )
