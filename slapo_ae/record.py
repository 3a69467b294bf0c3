"""The result record of one benchmark case: status, metrics, environment, log path.

One JSON file per case (``results/<experiment>/<profile>/<case-id>.json``), written
atomically: to a temporary file in the same directory, flushed and fsync'ed, then renamed over
the target with :func:`os.replace`. An interrupted run leaves either the old file or the new
one, never half of one. Failures are data: ``status`` is one of :data:`STATUSES` and
``reason`` says why.
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import functools
import hashlib
import importlib.metadata
import json
import os
import platform
import socket
import subprocess
from pathlib import Path

from slapo_ae import atomic, paths, textfile

STATUSES = ("ok", "oom", "unsupported", "failed")
REQUIRED_KEYS = ("status", "reason", "case", "metrics", "env")
SCHEMA_VERSION = 1
PACKAGES = {"torch": "torch", "transformers": "transformers", "deepspeed": "deepspeed",
            "megatron_core": "megatron-core", "slapo": "slapo"}


class RecordError(ValueError):
    """A record file that is unreadable or does not follow the schema."""


@dataclasses.dataclass
class Metrics:
    """Measured numbers; lists are per rank (memory, params) or per step (loss, times)."""

    samples_per_s: float | None = None  # median over timed steps
    spread: dict | None = None  # min, max, q1, q3, iqr, stdev, steps (metrics.throughput)
    flops_per_sample: float | None = None  # training model FLOPs, the paper's formula
    tflops_per_gpu: float | None = None
    mfu: float | None = None  # None where the device's peak is unknown
    peak_mem_bytes: list[int] = dataclasses.field(default_factory=list)  # per rank
    params: list[int] = dataclasses.field(default_factory=list)  # parameters per rank
    loss: list[float] = dataclasses.field(default_factory=list)  # per step
    step_times: list[float] = dataclasses.field(default_factory=list)  # s, warm-up included
    warmup_steps: int | None = None
    extra: dict = dataclasses.field(default_factory=dict)  # mode-specific numbers

    @classmethod
    def from_dict(cls, data: dict) -> Metrics:
        names = {f.name for f in dataclasses.fields(cls)}
        known = {k: v for k, v in data.items() if k in names}
        extra = {k: v for k, v in data.items() if k not in names}
        if extra:
            known["extra"] = {**known.get("extra", {}), **extra}
        return cls(**known)


@dataclasses.dataclass
class Record:
    """The outcome of one case. ``case`` takes a :class:`slapo_ae.case.Case` or its record."""

    status: str
    case: dict
    reason: str = ""
    metrics: Metrics = dataclasses.field(default_factory=Metrics)
    env: dict = dataclasses.field(default_factory=dict)
    log_path: str | None = None
    started_at: str | None = None
    finished_at: str | None = None
    schema: int = SCHEMA_VERSION

    def __post_init__(self):
        if self.status not in STATUSES:
            raise RecordError(f"status must be one of {STATUSES}, got {self.status!r}")
        if hasattr(self.case, "to_record"):
            self.case = self.case.to_record()
        if isinstance(self.metrics, dict):
            self.metrics = Metrics.from_dict(self.metrics)
        if self.log_path is not None:
            self.log_path = str(self.log_path)

    @property
    def id(self) -> str | None:
        return self.case.get("id")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Record:
        missing = [k for k in REQUIRED_KEYS if k not in data]
        if missing:
            raise RecordError(f"record lacks {', '.join(missing)}")
        if not isinstance(data["case"], dict) or not isinstance(data["metrics"], dict):
            raise RecordError("record's case and metrics must be objects")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def now() -> str:
    """The current time, UTC, ISO 8601 (for ``started_at`` / ``finished_at``)."""
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def iso(t: float | None) -> str | None:
    """An epoch time (``time.time()``), UTC, ISO 8601 as :func:`now` writes it; None stays."""
    if t is None:
        return None
    return _dt.datetime.fromtimestamp(t, _dt.UTC).isoformat(timespec="seconds")


def package_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


# Set where the project's tree travels without its git history (a copy sent to a GPU
# machine): the commit the copy was made from, recorded as ``git_commit``.
ENV_COMMIT = "SLAPO_AE_GIT_COMMIT"
SOURCE_PACKAGES = ("slapo", "slapo_ae")  # what source_hash covers


def git_commit(root=None) -> str | None:
    """HEAD of the project's own checkout (``root``, default the project root), ``+dirty`` if
    tracked files changed; ``$SLAPO_AE_GIT_COMMIT`` when set. None without git, or when
    ``root`` is not the top of a checkout: a copy of the tree inside another repository
    would otherwise record that repository's commit."""
    if os.environ.get(ENV_COMMIT):
        return os.environ[ENV_COMMIT]
    root = Path(root or paths.ROOT).resolve()
    try:
        def run(*args):
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                                  timeout=10)

        top = run("rev-parse", "--show-toplevel")
        if top.returncode or Path(top.stdout.strip()).resolve() != root:
            return None
        head = run("rev-parse", "HEAD")
        if head.returncode:
            return None
        dirty = run("diff", "--quiet", "HEAD").returncode == 1
        return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


@functools.cache
def source_hash(root=None) -> str:
    """``sha256:<hex>`` of the project's Python sources (:data:`SOURCE_PACKAGES`): their
    paths and contents, in path order. Names the code a record came from with or without
    git; equal hashes, equal code."""
    root = Path(root or paths.ROOT)
    digest = hashlib.sha256()
    for package in SOURCE_PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            digest.update(path.relative_to(root).as_posix().encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
    return "sha256:" + digest.hexdigest()


def cpu_model(cpuinfo="/proc/cpuinfo") -> str | None:
    """The CPU's model name as the kernel reports it (``model name`` in ``/proc/cpuinfo``),
    else the platform's processor string; None when neither says. A reviewer quotes it with
    the results, and on CPU ranks it is the hardware itself."""
    try:
        with open(cpuinfo) as lines:
            for line in lines:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    return " ".join(value.split())
    except OSError:
        pass
    return platform.processor() or None


def collect_env(device: dict) -> dict:
    """The environment a record was measured in: ``device`` (name, count, CUDA version:
    :func:`slapo_ae.gpus.describe`, or torch's view inside a rank), package versions, commit,
    host, the CPU's model and core count."""
    env = dict(device)
    env.update({name: package_version(dist) for name, dist in PACKAGES.items()})
    env.update({"git_commit": git_commit(), "source_hash": source_hash(),
                "hostname": socket.gethostname(),
                "python": platform.python_version(), "platform": platform.platform(),
                "cpu_model": cpu_model(), "cpu_count": os.cpu_count()})
    return env


def non_ok(case: dict, status: str, reason: str, *, env: dict, log_path=None, started_at=None,
           extra: dict | None = None) -> Record:
    """The record of a case that measured nothing (``unsupported``, ``failed``, ``oom``): the
    one factory of such records, whoever finds the failure (the case runner, the launcher, a
    rank, the CLI). ``extra`` goes to ``metrics.extra`` (run id, notes, who recorded it)."""
    return Record(status=status, case=case, reason=reason, metrics=Metrics(extra=dict(extra or {})),
                  env=env, log_path=log_path,
                  started_at=started_at or now(), finished_at=now())


def _jsonable(obj):
    """JSON fallback for numpy/torch scalars and arrays and paths; anything else is an error."""
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if hasattr(obj, "item"):
        return obj.item()
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


def write_record(record: Record | dict, path) -> Path:
    """Write ``record`` as JSON to ``path`` atomically (:mod:`slapo_ae.atomic`)."""
    data = record.to_dict() if isinstance(record, Record) else Record.from_dict(record).to_dict()
    return atomic.write_text(path, json.dumps(data, indent=2, default=_jsonable) + "\n")


def read_record(path) -> Record:
    """Read and validate a record file; :class:`RecordError` names the file on any problem."""
    try:
        data = json.loads(textfile.read_text(path))
    except textfile.NotTextError as err:
        raise RecordError(f"cannot read record: {err}") from None
    except (OSError, json.JSONDecodeError) as err:
        raise RecordError(f"{path}: cannot read record: {err}") from None
    if not isinstance(data, dict):
        raise RecordError(f"{path}: a record must be a JSON object")
    try:
        return Record.from_dict(data)
    except (RecordError, TypeError) as err:
        raise RecordError(f"{path}: {err}") from None
