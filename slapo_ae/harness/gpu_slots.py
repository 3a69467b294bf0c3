"""A file-lock GPU slot allocator: concurrent jobs get disjoint ``CUDA_VISIBLE_DEVICES``.

Snakemake's ``--resources gpus=8`` bounds how many GPUs the running jobs declare in total, but
it does not say *which* GPUs a job gets. Each job therefore takes its GPUs here, as slots
``0 .. total-1``, one lock file per slot in a shared folder:

- a slot is taken by holding an exclusive ``flock`` on ``slot-<i>.lock``; the kernel drops the
  lock when the last holder of the file descriptor exits, so a killed job never leaves a slot
  taken (no stale lock files to clean up);
- a job takes all its slots while holding ``alloc.lock``, trying each slot without blocking;
  when fewer than it needs are free it releases what it took and waits, so two jobs never
  deadlock on half an allocation;
- slot ``i`` is mapped to the i-th entry of the parent's ``CUDA_VISIBLE_DEVICES`` when that is
  set (the job's share of the machine), else to GPU ``i``.

When Snakemake's ``--resources gpus=N`` matches the slots, a job finds its slots free at once;
without it the allocator itself keeps jobs from sharing a GPU (they wait).

    with GpuSlots(lock_dir, total=8).acquire(2) as slots:
        env["CUDA_VISIBLE_DEVICES"] = slots.visible_devices
"""
from __future__ import annotations

import argparse
import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path

from slapo_ae import gpus


class SlotError(RuntimeError):
    """A request that can never be satisfied (more GPUs than slots)."""


class Allocation:
    """Slots held by this process; release with :meth:`release` or as a context manager."""

    def __init__(self, slots: list[int], fds: list[int], devices: list[str]):
        self.slots = slots
        self.fds = fds
        self.devices = devices

    @property
    def visible_devices(self) -> str:
        """The value for ``CUDA_VISIBLE_DEVICES``."""
        return ",".join(self.devices)

    def release(self) -> None:
        for fd in self.fds:
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)
        self.fds = []

    def __enter__(self) -> Allocation:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class GpuSlots:
    """``total`` GPU slots whose locks live in ``lock_dir``."""

    def __init__(self, lock_dir, total: int, visible: str | None = None):
        if total < 0:
            raise ValueError(f"total must be >= 0, got {total}")
        self.lock_dir = Path(lock_dir)
        self.total = total
        ids = gpus.visible_ids(visible)
        if ids is not None and len(ids) < total:
            raise SlotError(f"{total} slots but CUDA_VISIBLE_DEVICES lists only {len(ids)}: "
                            f"{visible!r}")
        self.devices = ids[:total] if ids is not None else [str(i) for i in range(total)]

    def _open(self, name: str) -> int:
        self.lock_dir.mkdir(parents=True, exist_ok=True)
        return os.open(self.lock_dir / name, os.O_RDWR | os.O_CREAT, 0o666)

    def try_acquire(self, count: int) -> Allocation | None:
        """Take ``count`` free slots now, or None if fewer are free."""
        if count > self.total:
            raise SlotError(f"a job needs {count} GPUs but only {self.total} are available")
        if count <= 0:
            return Allocation([], [], [])
        guard = self._open("alloc.lock")
        try:
            fcntl.flock(guard, fcntl.LOCK_EX)
            slots, fds = [], []
            for slot in range(self.total):
                fd = self._open(f"slot-{slot}.lock")
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                slots.append(slot)
                fds.append(fd)
                if len(slots) == count:
                    return Allocation(slots, fds, [self.devices[s] for s in slots])
            Allocation(slots, fds, []).release()
            return None
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)
            os.close(guard)

    def acquire(self, count: int, timeout: float | None = None, poll: float = 0.2,
                on_wait=None) -> Allocation:
        """Take ``count`` slots, waiting for them (``timeout`` seconds at most, None: forever).

        ``on_wait`` is called once, with no argument, if the slots are not free at once.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        waited = False
        while True:
            alloc = self.try_acquire(count)
            if alloc is not None:
                return alloc
            if not waited and on_wait is not None:
                on_wait()
            waited = True
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"no {count} free GPU slots of {self.total} in {timeout} s")
            time.sleep(poll)


def main(argv=None) -> int:
    """``python -m slapo_ae.harness.gpu_slots --dir D --total T --gpus N -- CMD ...``:
    run CMD with ``N`` GPU slots held and ``CUDA_VISIBLE_DEVICES`` set to them."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--dir", required=True, help="folder of the slot lock files")
    parser.add_argument("--total", type=int, required=True, help="GPUs on this machine")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs this command needs")
    parser.add_argument("--timeout", type=float, default=None)
    parser.add_argument("cmd", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        parser.error("no command given")
    slots = GpuSlots(args.dir, args.total, os.environ.get("CUDA_VISIBLE_DEVICES"))
    with slots.acquire(args.gpus, timeout=args.timeout) as alloc:
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=alloc.visible_devices)
        return subprocess.run(cmd, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
