"""The one supervisor of child process trees: the harness under the workflow's case runner
(:mod:`slapo_ae.harness.runner`) and torchrun under the harness (:mod:`slapo_ae.harness.launch`).

:func:`supervise` runs a child in a session of its own that gets SIGTERM when its parent dies
(Linux), waits for it up to a timeout, and stops it with everything below it
(:func:`stop_trees`) when the timeout passes or when this process is told to stop (SIGTERM,
SIGINT, SIGHUP: then :class:`Interrupted` is raised once the tree is down, and stop signals
stay ignored, so that the caller's last notes are not cut short). :func:`supervise_all` does
the same for several children at once, the agents of a case on several nodes started on one
machine, and stops them all when one fails.
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


def stop_trees(procs: list[subprocess.Popen], grace: float = KILL_GRACE_S) -> None:
    """SIGTERM each child's process group (so it can stop what it started), wait up to
    ``grace`` seconds (one period for all), then SIGKILL each child and every process below
    it: torchrun starts each rank in a session of its own, so a signal to one group alone does
    not reach them."""
    trees = {proc.pid: descendants(proc.pid) for proc in procs}
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for proc in procs:
        for pid in [proc.pid, *trees[proc.pid], *descendants(proc.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    for proc in procs:
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def ignore_stop_signals() -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def raise_on_stop_signals() -> dict:
    """From now on a stop signal raises :class:`Interrupted` (once: the handler first makes
    this process deaf to stop signals, so that a second Ctrl-C cannot cut the clean-up short
    or print a traceback). Returns the handlers it replaced."""

    def on_signal(signum, frame):
        ignore_stop_signals()
        raise Interrupted(signum)

    return {sig: signal.signal(sig, on_signal) for sig in STOP_SIGNALS}


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
    return supervise_all([cmd], timeout=timeout, envs=[env], stdout=stdout, pass_fds=pass_fds)


POLL_S = 0.5  # how often several children are looked at (one child is simply waited for)


def supervise_all(cmds: list[list[str]], *, timeout: float, envs: list[dict | None] | None = None,
                  stdout=None, pass_fds: tuple = ()) -> Outcome:
    """Run every command of ``cmds`` at once, each as :func:`supervise` runs one (a session of
    its own, the same ``stdout``, ``pass_fds`` and one shared ``timeout``), ``envs[i]`` the
    environment of ``cmds[i]``. When one exits with a non-zero code the others are stopped, as
    srun's ``--kill-on-bad-exit`` does (the agents of a case on several nodes would wait for
    it until the timeout), and the outcome is that first failure's code; 0 when all ended
    with 0."""
    envs = list(envs) if envs is not None else [None] * len(cmds)
    procs: list[subprocess.Popen] = []

    previous = raise_on_stop_signals()
    interrupted = False
    start = time.monotonic()
    try:
        for cmd, env in zip(cmds, envs):
            try:
                procs.append(subprocess.Popen(
                    cmd, env=env, stdout=stdout, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, pass_fds=pass_fds,
                    preexec_fn=own_session_and_parent_death_signal()))
            except OSError:  # a command that cannot start: none of its siblings is left
                stop_trees(procs)
                raise
        while True:
            codes = [proc.poll() for proc in procs]
            failed = [code for code in codes if code not in (None, 0)]
            if failed:
                stop_trees([proc for proc in procs if proc.returncode is None])
                return Outcome(failed[0], False, time.monotonic() - start)
            if None not in codes:
                return Outcome(0, False, time.monotonic() - start)
            remaining = timeout - (time.monotonic() - start)
            if remaining <= 0:
                stop_trees(procs)
                codes = [proc.returncode for proc in procs]
                code = next((c for c in codes if c not in (None, 0)), codes[0])
                return Outcome(code, True, time.monotonic() - start)
            waiting = next(proc for proc in procs if proc.returncode is None)
            try:
                waiting.wait(timeout=remaining if len(procs) == 1 else min(POLL_S, remaining))
            except subprocess.TimeoutExpired:
                pass
    except Interrupted:
        # A second Ctrl-C must not cut the clean-up short, here or in the caller's notes
        # after it: a process told to stop stays deaf to stop signals from now on (the
        # handler made it so).
        interrupted = True
        stop_trees(procs)
        raise
    finally:
        if not interrupted:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
