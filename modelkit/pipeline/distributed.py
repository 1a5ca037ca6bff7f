"""Data-parallel set-up for training launched by `torchrun` (gloo on CPU, nccl on CUDA).

Outside torchrun everything here is a no-op with world size 1, so the same training loop runs
in one process or many.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Only rank 0 writes files and prints."""
        return self.rank == 0


def from_environment() -> DistInfo:
    """Read torchrun's RANK / WORLD_SIZE / LOCAL_RANK (absent: a single process)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    return DistInfo(int(os.environ.get("RANK", "0")), world, int(os.environ.get("LOCAL_RANK", "0")))


def resolve_device(name: str, info: DistInfo) -> torch.device:
    """'auto' picks cuda, then mps, then cpu; each rank takes its own GPU."""
    if name == "auto":
        if torch.cuda.is_available():
            name = "cuda"
        elif getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available() and not info.enabled:
            name = "mps"
        else:
            name = "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            from modelkit.errors import ConfigError

            raise ConfigError("--device cuda was asked for but torch sees no CUDA device; use --device cpu or auto")
        return torch.device("cuda", info.local_rank % torch.cuda.device_count())
    if name == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        from modelkit.errors import ConfigError

        raise ConfigError("--device mps was asked for but this machine has no MPS device; use --device cpu or auto")
    return torch.device(name)


def init(info: DistInfo, device: torch.device) -> None:
    """Join the process group: nccl when every rank has a GPU, gloo otherwise."""
    if info.enabled and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")


def shutdown(info: DistInfo) -> None:
    if info.enabled and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sums(sums: dict[str, float], info: DistInfo, device: torch.device) -> dict[str, float]:
    """Add each rank's metric sums together (identity in a single process)."""
    if not info.enabled:
        return sums
    keys = sorted(sums)
    totals = torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    return dict(zip(keys, totals.tolist(), strict=True))


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()
