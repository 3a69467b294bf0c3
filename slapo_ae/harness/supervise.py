"""The one supervisor of child process trees: the harness under the workflow's case runner
(:mod:`slapo_ae.harness.runner`) and torchrun under the harness (:mod:`slapo_ae.harness.launch`).

:func:`supervise` runs a child in a session of its own that gets SIGTERM when its parent dies
(Linux), waits for it up to a timeout, and stops it with everything below it
(:func:`stop_tree`) when the timeout passes or when this process is told to stop (SIGTERM,
SIGINT, SIGHUP: then :class:`Interrupted` is raised once the tree is down, and stop signals
stay ignored, so that the caller's last notes are not cut short).
"""
from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import time
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


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def ignore_stop_signals() -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def die_with_parent(signum: int = signal.SIGTERM) -> None:
    """Ask Linux to send this process ``signum`` when its parent dies (no-op elsewhere): a
    process that a killed parent would leave behind stops itself instead."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signum)
    except (OSError, AttributeError):
        pass


class Interrupted(BaseException):
    """This process was told to stop while supervising a child (the child is stopped).
    A BaseException, like KeyboardInterrupt, so that no ``except Exception`` swallows it."""

    def __init__(self, signum: int):
        super().__init__(f"interrupted by signal {signum}")
        self.signum = signum


@dataclasses.dataclass
class Outcome:
    returncode: int | None  # None: it had to be killed and did not report one
    timed_out: bool
    seconds: float


def supervise(cmd: list[str], *, timeout: float, env: dict | None = None, stdout=None,
              pass_fds: tuple = ()) -> Outcome:
    """Run ``cmd`` to the end or to ``timeout`` seconds (see the module docstring); its output
    goes to ``stdout`` (a file), stderr with it, stdin is empty."""
    proc = None

    def on_signal(signum, frame):
        raise Interrupted(signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in STOP_SIGNALS}
    interrupted = False
    start = time.monotonic()
    try:
        proc = subprocess.Popen(cmd, env=env, stdout=stdout, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, pass_fds=pass_fds,
                                preexec_fn=own_session_and_parent_death_signal())
        try:
            return Outcome(proc.wait(timeout=timeout), False, time.monotonic() - start)
        except subprocess.TimeoutExpired:
            stop_tree(proc)
            return Outcome(proc.returncode, True, time.monotonic() - start)
    except Interrupted:
        # A second Ctrl-C must not cut the clean-up short, here or in the caller's notes
        # after it: a process told to stop stays deaf to stop signals from now on.
        interrupted = True
        ignore_stop_signals()
        if proc is not None:
            stop_tree(proc)
        raise
    finally:
        if not interrupted:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
