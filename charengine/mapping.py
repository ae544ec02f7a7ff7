"""Where a TP rank runs: the mapping from a target's layout to one rank's devices and group,
derived once from the target and passed explicitly to everything that builds or runs a rank
(TensorRT-LLM's Mapping is the model)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch


def split_evenly(total: int, parts: int, rank: int) -> tuple[int, int]:
    """(offset, size) of `rank`'s share when `total` whole units go to `parts` ranks, the first
    total % parts ranks taking one more."""
    base, extra = divmod(total, parts)
    size = base + (rank < extra)
    offset = rank * base + min(rank, extra)
    return offset, size


def identity(t: torch.Tensor) -> torch.Tensor:
    return t


@dataclass(frozen=True)
class Mapping:
    """One TP rank of a layout: rank `rank` of `tp`, on `device`, the decoder (and audio
    encoder) on `decoder_device`; `group` the TP group's process group (None: the default
    group, or none at TP-1). With `host_process`, a host process (audio, decoder, pacing) is
    global rank 0 of the processes and TP rank r is global rank r + 1 (charrun's TP layout);
    without, the TP ranks are the whole group (one process at TP-1, the tests' TP groups).
    `alone`: this rank runs without its group, its all-reduce left out (a benchmark of one
    rank's work; its outputs are not the model's)."""

    tp: int = 1
    rank: int = 0
    device: str = "cpu"
    decoder_device: str = "cpu"
    host_process: bool = False
    alone: bool = False
    group: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if not 0 <= self.rank < self.tp:
            raise ValueError(f"rank {self.rank} outside TP group of {self.tp}")

    @property
    def global_rank(self) -> int:
        return self.rank + 1 if self.host_process else self.rank

    @property
    def world_size(self) -> int:
        """Processes in the group: the TP ranks and, with a host process, that one."""
        return self.tp + 1 if self.host_process else self.tp

    @property
    def tp_global_ranks(self) -> list[int]:
        """Global ranks of the TP group."""
        first = 1 if self.host_process else 0
        return list(range(first, first + self.tp))

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    def with_group(self, group) -> "Mapping":
        return dataclasses.replace(self, group=group)

    def slice_alone(self, device: str) -> "Mapping":
        """This rank's work alone on `device` (with its decoder there)."""
        return Mapping(self.tp, self.rank, device, device, alone=True)

    def all_reduce(self):
        """The TP group's sum, in place (identity at TP-1 or alone)."""
        if self.tp == 1 or self.alone:
            return identity
        import torch.distributed as dist

        group = self.group

        def all_reduce(t: torch.Tensor) -> torch.Tensor:
            dist.all_reduce(t, group=group)
            return t

        return all_reduce

    @classmethod
    def single(cls, device="cpu", tp: int = 1, rank: int = 0) -> "Mapping":
        """TP rank `rank` on `device` with its decoder there too (tests, benchmarks, TP-1)."""
        return cls(tp, rank, str(device), str(device))
