"""The CPU threads of a harness run: how a case's cores are shared among its ranks.

A case that holds ``cores`` CPU cores and runs ``ranks`` processes gives each rank
``max(1, cores // ranks)`` intra-op threads and :data:`INTEROP_THREADS` inter-op thread, on
CPU and on CUDA alike. The harness sets this for every rank of every system, whatever the
caller's environment holds: Snakemake exports ``OMP_NUM_THREADS`` equal to a job's ``threads``,
and ranks that inherit it oversubscribe the cores (measured 5-20x slower on tensor-parallel
cases, whose lock-step collectives pay for every descheduling).

- the parent puts the budget into the ranks' environment (:func:`thread_env`: OpenMP, MKL,
  OpenBLAS and the other BLAS pools, so no library starts a pool of its own size);
- each rank applies it to torch before any work (:func:`apply_in_rank`) and reports what torch
  then uses (:func:`threads_in_use`), which goes into the record's ``env``.

``cores`` defaults to :func:`default_cores`: on CPU one core per rank (a rank stands for a
GPU, so a case on N "GPUs" gets N cores' worth of compute, and Figure 9's tensor-parallel steps
get more hardware than its one-device steps, as on GPUs); on CUDA every core this process may
run on, shared by the ranks. The workflow passes the same (``plan.rank_cores``).
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

INTEROP_THREADS = 1  # a rank runs one stream of ops; an inter-op pool would only compete
THREAD_ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                   "BLIS_NUM_THREADS", "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")


def cpu_affinity() -> list[int] | None:
    """The cores this process may run on; None where the platform cannot say (not Linux)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:
        return None


def available_cores() -> int:
    """How many cores this process may run on (``os.cpu_count()`` without an affinity)."""
    affinity = cpu_affinity()
    return len(affinity) if affinity is not None else (os.cpu_count() or 1)


RANKS_PER_CORE = 4  # CPU ranks beyond this many per core only time-share: refused
RANK_MEMORY_BYTES = 2**30  # what one CPU rank needs at least (torch, a tiny model)


def proc_number(path: str, key: str) -> int | None:
    """The number after ``key`` on its line of a Linux /proc table (``/proc/meminfo``,
    ``/proc/vmstat``), None where the file or the line is missing."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.split(maxsplit=1)[:1] == [key]:
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def available_memory() -> int | None:
    """Bytes of memory available for new processes (``MemAvailable``), None if unknown."""
    kib = proc_number("/proc/meminfo", "MemAvailable:")
    return None if kib is None else kib * 1024


def cpu_rank_limit() -> tuple[int, str]:
    """How many CPU ranks this machine can hold, and the rule: at most
    :data:`RANKS_PER_CORE` per core available and one per :data:`RANK_MEMORY_BYTES` of
    memory available."""
    cores = available_cores()
    limit, rule = RANKS_PER_CORE * cores, f"{RANKS_PER_CORE} per core on {cores} cores"
    memory = available_memory()
    if memory is not None and memory // RANK_MEMORY_BYTES < limit:
        limit = max(1, memory // RANK_MEMORY_BYTES)
        rule = f"one per GiB of the {memory / 2**30:.1f} GiB available"
    return limit, rule


def default_cores(device: str, ranks: int) -> int:
    """The cores a case holds unless told: its rank count on CPU, all available on CUDA."""
    return ranks if device == "cpu" else available_cores()


@dataclasses.dataclass(frozen=True)
class ThreadBudget:
    """``cores`` shared by ``ranks``: ``intra_op`` threads per rank, ``inter_op`` each."""

    cores: int
    ranks: int
    intra_op: int
    inter_op: int = INTEROP_THREADS

    @classmethod
    def for_case(cls, cores: int, ranks: int) -> ThreadBudget:
        if cores < 1 or ranks < 1:
            raise ValueError(f"cores ({cores}) and ranks ({ranks}) must be at least 1")
        return cls(cores=cores, ranks=ranks, intra_op=max(1, cores // ranks))

    @property
    def oversubscribed(self) -> bool:
        """More threads than cores (fewer cores than ranks)."""
        return self.intra_op * self.ranks > self.cores

    def as_env_record(self) -> dict:
        """The record's ``env`` entries of the budget."""
        return {"cores": self.cores, "ranks": self.ranks, "threads_per_rank": self.intra_op,
                "interop_threads_per_rank": self.inter_op}


def thread_env(budget: ThreadBudget) -> dict[str, str]:
    """The ranks' thread variables: every BLAS/OpenMP pool sized to the rank's share."""
    return {name: str(budget.intra_op) for name in THREAD_ENV_VARS}


def apply_in_rank(budget: ThreadBudget) -> None:
    """Size torch's pools in this rank (call before any torch work: the inter-op pool can be
    sized only once, before it starts)."""
    import torch

    torch.set_num_threads(budget.intra_op)
    try:
        torch.set_num_interop_threads(budget.inter_op)
    except RuntimeError:  # already started (torch was used before): keep what it has
        pass


def threads_in_use() -> dict:
    """What this rank's torch and OpenMP actually use, for the record."""
    import torch

    return {"torch_threads": torch.get_num_threads(),
            "torch_interop_threads": torch.get_num_interop_threads(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "cpu_affinity": cpu_affinity()}
