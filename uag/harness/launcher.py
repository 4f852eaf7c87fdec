"""Processes started together by a launcher (``torchrun``, or anything that sets ``RANK``,
``WORLD_SIZE`` and ``LOCAL_RANK``): which share of the work is this process's, on which device.

Why a module of its own: ``uag collect`` shards prompts by rank and picks each rank's device from
it, and a malformed value must be one clear error, not a silent single-process run.
(``train-controller`` needs none of this: Lightning reads the same variables itself.)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from uag.errors import UagError


@dataclass(frozen=True)
class Launch:
    """This process's place among those a launcher started."""

    rank: int
    world_size: int
    local_rank: int
    coordinated: bool
    """``MASTER_ADDR`` and ``MASTER_PORT`` are set: the processes can meet (a barrier)."""

    @property
    def shard(self) -> tuple[int, int]:
        return self.rank, self.world_size

    def device(self, requested: str) -> str:
        """``auto`` becomes this process's own GPU (``cuda:LOCAL_RANK``) when GPUs exist, else
        the CPU; an explicit choice stays as asked."""
        if requested != "auto":
            return requested

        if not torch.cuda.is_available():
            return "cpu"
        count = torch.cuda.device_count()
        if self.local_rank >= count:
            raise UagError(
                f"LOCAL_RANK {self.local_rank} has no GPU of its own ({count} visible): "
                "start at most one process per GPU"
            )
        return f"cuda:{self.local_rank}"


def _int(env: Mapping[str, str], name: str, default: str | None = None) -> int:
    raw = env.get(name, default)
    try:
        return int(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise UagError(f"the launcher set {name}={raw!r}: expected an integer") from None


def from_env(env: Mapping[str, str] | None = None) -> Launch | None:
    """The launch this process belongs to, or None when it runs alone (no ``WORLD_SIZE`` > 1)."""
    env = os.environ if env is None else env
    if "WORLD_SIZE" not in env:
        return None
    world = _int(env, "WORLD_SIZE")
    if world <= 1:
        return None
    rank = _int(env, "RANK")
    local = _int(env, "LOCAL_RANK", env.get("RANK"))
    if not 0 <= rank < world:
        raise UagError(f"the launcher set RANK={rank} outside 0..{world - 1} (WORLD_SIZE={world})")
    return Launch(
        rank=rank,
        world_size=world,
        local_rank=local,
        coordinated="MASTER_ADDR" in env and "MASTER_PORT" in env,
    )
