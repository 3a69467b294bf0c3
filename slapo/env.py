"""Upstream Slapo's launch helpers (``slapo.env``, also ``slapo.setup``/``execute``), which its
example scripts use to run a training function on several local processes:

    def train(rank, args):
        slapo.env.setup(rank, args.world_size)
        ...
    slapo.execute(train, args)        # args.world_size processes, train(rank, args) in each

Upstream's ``setup`` always took NCCL and a GPU per rank; here the backend follows the machine
(NCCL with a GPU per rank where CUDA has enough of them, else gloo on CPU), so that the same
script runs on CPU ranks. ``torchrun`` is the launcher for anything larger.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def setup(rank: int, world_size: int, backend: str | None = None) -> None:
    """Join this process to a local process group of ``world_size`` ranks as ``rank``.
    ``MASTER_ADDR``/``MASTER_PORT`` default to localhost:12355, as upstream's (values already
    in the environment are kept)."""
    os.environ.setdefault("MASTER_ADDR", "localhost")
    os.environ.setdefault("MASTER_PORT", "12355")
    on_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= world_size
    backend = backend or ("nccl" if on_gpus else "gloo")
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    if on_gpus:
        torch.cuda.set_device(rank)


def cleanup() -> None:
    """Leave the process group ``setup`` joined."""
    dist.destroy_process_group()


def execute(fn, args) -> None:
    """Run ``fn(rank, args)`` in ``args`` processes (an int) or ``args.world_size`` processes
    (an ``argparse`` namespace), and wait for all of them; a failing one raises here."""
    nprocs = args if isinstance(args, int) else args.world_size
    mp.spawn(fn, args=(args,), nprocs=nprocs, join=True)
