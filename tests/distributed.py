"""Run a function on N CPU ranks over gloo and collect each rank's return value."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world_size: int, workdir: str, fn, args) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/rendezvous",
                            rank=rank, world_size=world_size)
    try:
        result = fn(*args)
        torch.save(result, Path(workdir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
    # Leave without Python's finalization, as the harness's ranks do: gloo's worker threads,
    # where anything still holds the group, may free a finished collective's tensors then,
    # and a thread that takes the GIL while Python finalizes aborts the rank ("terminate
    # called without an active exception", SIGABRT: CI, 2026-12-04).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn, *args, world_size: int = 2) -> list:
    """``fn(*args)`` on ``world_size`` spawned processes; returns their results by rank.

    ``fn`` must be importable (a module-level function). An exception on any rank fails the
    call with that rank's traceback.
    """
    with tempfile.TemporaryDirectory() as workdir:
        mp.spawn(_entry, args=(world_size, workdir, fn, args), nprocs=world_size, join=True)
        return [torch.load(Path(workdir) / f"rank{r}.pt", weights_only=False)
                for r in range(world_size)]
