"""Child processes that must never outlive their parent: torchrun under the harness
(:mod:`slapo.bench.launch`) and the harness under the workflow's case runner
(:mod:`slapo.bench.workflow.run_case`). Each child runs in a session of its own and gets SIGTERM
when its parent dies (Linux); :func:`stop_tree` stops it with everything below it.
"""
from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

KILL_GRACE_S = 10  # after SIGTERM, how long a child may take to stop before SIGKILL
PR_SET_PDEATHSIG = 1


def own_session_and_parent_death_signal():
    """A ``preexec_fn`` for ``subprocess.Popen``: a session of its own (so it can be signalled
    as a group) and SIGTERM when the parent dies. libc is loaded here, before the fork: the
    child runs no imports."""
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        prctl = None

    def setup() -> None:
        os.setsid()
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, signal.SIGTERM)

    return setup


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux /proc; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def stop_tree(proc: subprocess.Popen, grace: float = KILL_GRACE_S) -> None:
    """SIGTERM the child's process group (so it can stop what it started), wait up to
    ``grace`` seconds, then SIGKILL the child and every process below it: torchrun starts each
    rank in a session of its own, so a signal to one group alone does not reach them."""
    tree = descendants(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    for pid in [proc.pid, *tree, *descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
