"""The parallel layout of a job: its degrees, where each rank sits, and its process groups — the one place that
knows the mesh. Built once from the config and the worker count (``make_plan``: ``RunPlan.dims``).

Ranks are laid out as ``rank = (d * N + s) * M + t`` (data-parallel index ``d``, sequence-parallel index ``s`` of
``N = parallel.sequence``, tensor-parallel index ``t`` of ``M = parallel.tensor``): tensor-parallel groups are
``M`` consecutive ranks, as DeepSpeed's AutoTP mesh makes them; a sequence-parallel group is the ``N`` ranks of one
``(d, t)``, ``M`` apart; the ``N * M`` ranks of one data-parallel index train on the same sequences. DeepSpeed is
not told about sequence parallelism: its data-parallel group (the ranks ZeRO partitions over) spans ``D x N``
ranks, and the loss scaling of ``sequence.py`` makes its gradient average the average over the ``D`` data-parallel
ranks. Expert-parallel groups are ``E = parallel.expert`` consecutive ranks (DeepSpeed's layout): the expert rank
of ``rank`` is ``rank % E``.

No torch at import (the config imports this module); :meth:`ParallelDims.sequence_group` imports
``torch.distributed`` when it is called.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Process groups are created collectively, once per layout and default group (a growth rebuild reuses them).
_SEQUENCE_GROUPS: dict[tuple[int, int, int, int], tuple[Any, int]] = {}


@dataclass(frozen=True)
class ParallelDims:
    """The degrees of one job on ``world`` workers (each >= 1; ``world`` a multiple of ``sequence x tensor`` and
    of ``expert``: ``pretrain/parallel/rules.py`` checks that before one is built)."""

    world: int = 1
    """All workers."""
    sequence: int = 1
    """Workers sharing each sequence (``parallel.sequence``, DeepSpeed Ulysses)."""
    tensor: int = 1
    """Workers sharing each layer (``parallel.tensor``, DeepSpeed AutoTP)."""
    expert: int = 1
    """Workers sharing the experts of each MoE layer (``parallel.expert``; 1 for a dense model)."""

    def __post_init__(self) -> None:
        assert min(self.world, self.sequence, self.tensor, self.expert) >= 1, self
        assert self.world % self.model_parallel == 0 and self.world % self.expert == 0, self

    @classmethod
    def from_config(cls, cfg: Any, world_size: int) -> ParallelDims:
        """The layout of ``cfg`` (a ``RunConfig``; this module sits below the config tree) on ``world_size`` workers:
        the expert degree counts only for an MoE model."""
        p = cfg.parallel
        return cls(
            world=world_size,
            sequence=p.sequence,
            tensor=p.tensor,
            expert=p.expert if cfg.moe.enabled else 1,
        )

    # -- degrees ---------------------------------------------------------------------------------------------

    @property
    def model_parallel(self) -> int:
        """Workers that train on the same sequences: ``sequence x tensor``."""
        return self.sequence * self.tensor

    @property
    def data(self) -> int:
        """Data-parallel degree: the workers that take different sequences."""
        return self.world // self.model_parallel

    @property
    def zero(self) -> int:
        """ZeRO sharding degree: the ranks ZeRO partitions over (DeepSpeed's data-parallel group, ``data x
        sequence``: every rank of one tensor-parallel index)."""
        return self.world // self.tensor

    @property
    def enabled(self) -> bool:
        """Whether any model parallelism (sequence or tensor) is used."""
        return self.model_parallel > 1

    # -- rank mapping ----------------------------------------------------------------------------------------

    def rank(self, data: int, sequence: int = 0, tensor: int = 0) -> int:
        """The global rank at ``(data, sequence, tensor)``: ``(d * N + s) * M + t``."""
        return (data * self.sequence + sequence) * self.tensor + tensor

    def data_rank(self, rank: int) -> int:
        """The data-parallel index of global ``rank``."""
        return rank // self.model_parallel

    def sequence_rank(self, rank: int) -> int:
        """The index of global ``rank`` in its sequence-parallel group (its slice of every sequence)."""
        return (rank // self.tensor) % self.sequence

    def tensor_rank(self, rank: int) -> int:
        """The index of global ``rank`` in its tensor-parallel group."""
        return rank % self.tensor

    def expert_rank(self, rank: int) -> int:
        """The expert-parallel index of global ``rank`` (expert-parallel groups are consecutive ranks)."""
        return rank % self.expert

    def expert_data_rank(self, rank: int) -> int:
        """The index of global ``rank`` in its expert-data-parallel group (the ranks holding the same experts, which
        partition their ZeRO state): the index of its expert-parallel group."""
        return rank // self.expert

    def shares_data(self, rank: int) -> bool:
        """Whether ``rank`` is the first of the workers training on its sequences (the one whose sums count when
        every worker's are added up)."""
        return rank % self.model_parallel == 0

    # -- groups ----------------------------------------------------------------------------------------------

    def sequence_groups(self) -> list[list[int]]:
        """Every sequence-parallel group's ranks, in the order every rank creates them."""
        return [
            [first + s * self.tensor for s in range(self.sequence)]
            for first in range(self.world)
            if (first // self.tensor) % self.sequence == 0
        ]

    def tensor_groups(self) -> list[list[int]]:
        """Every tensor-parallel group's ranks (consecutive; DeepSpeed creates these)."""
        return [list(range(first, first + self.tensor)) for first in range(0, self.world, self.tensor)]

    def expert_groups(self) -> list[list[int]]:
        """Every expert-parallel group's ranks (consecutive; DeepSpeed creates these)."""
        return [list(range(first, first + self.expert)) for first in range(0, self.world, self.expert)]

    def sequence_group(self) -> tuple[Any, int]:
        """(this rank's sequence-parallel ``ProcessGroup``, its index in it). Collective the first time for a layout:
        every rank creates every group, in the same order; later calls return the cached group."""
        import torch.distributed as dist

        key = (id(dist.group.WORLD), self.world, self.sequence, self.tensor)
        if key not in _SEQUENCE_GROUPS:
            rank, mine = dist.get_rank(), None
            for ranks in self.sequence_groups():
                group = dist.new_group(ranks)
                if rank in ranks:
                    mine = (group, ranks.index(rank))
            assert mine is not None
            _SEQUENCE_GROUPS[key] = mine
        return _SEQUENCE_GROUPS[key]

    def describe(self) -> str:
        """``2 data x 2 sequence x 1 tensor parallel`` (the plan's line)."""
        return f"{self.data} data x {self.sequence} sequence x {self.tensor} tensor parallel"
