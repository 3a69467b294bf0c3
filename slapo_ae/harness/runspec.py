"""One harness run: a :class:`~slapo_ae.case.Case` and where and how to run it, passed from the
parent to the ranks.

The parent (``slapo-bench run``) builds a :class:`RunSpec` from its command line, checks it,
and hands it to every rank as one JSON argument (``python -m slapo_ae.harness.worker --spec
JSON``). The module imports neither torch nor a model library.
"""
from __future__ import annotations

import dataclasses
import json

from slapo_ae.case import Case
from slapo_ae.harness.threads import ThreadBudget, default_cores

TIMEOUT_GPU_S = 1800
TIMEOUT_CPU_BASE_S = 600
TIMEOUT_CPU_PER_STEP_S = 120


def default_timeout(device: str, steps: int) -> int:
    """Seconds after which a run is killed: 1800 on CUDA; on CPU 600 + 120 per step (launch
    and model build, then a generous bound on each step of a CPU-sized model)."""
    if device == "cuda":
        return TIMEOUT_GPU_S
    return TIMEOUT_CPU_BASE_S + TIMEOUT_CPU_PER_STEP_S * steps


@dataclasses.dataclass
class RunSpec:
    """A case (with its run settings) and how this launch runs it."""

    case: Case
    out: str
    log: str | None = None
    timeout: float | None = None
    case_id: str | None = None  # the record's case id, if not the case's own (--case-id)
    cores: int | None = None  # CPU cores the case holds, shared by its ranks (threads.py)
    memory_per_rank: int | None = None  # bytes of data a rank may hold (RLIMIT_DATA), if capped
    profile_dir: str | None = None  # where each rank writes its torch.profiler tables
    # > 0: profile that many steps after the timed ones (left out of the record's figures)
    # instead of the timed steps themselves
    profile_after: int = 0
    run_id: str = ""  # ties the record rank 0 writes to this launch
    launch_time: float | None = None  # parent's time.time() just before starting torchrun
    rundir: str | None = None  # where ranks leave their status files
    rdzv_endpoint: str | None = None  # host:port every node's torchrun meets at (nodes > 1)

    def __post_init__(self):
        if self.case.nodes > 1 and not self.run_id:
            # every node runs the same command: the same case and endpoint give the same id,
            # which is the rendezvous id and ties rank 0's record to the launch on each node
            import hashlib

            key = f"{self.case.to_json()}@{self.rdzv_endpoint}"
            self.run_id = hashlib.sha1(key.encode()).hexdigest()[:16]

    def case_dict(self) -> dict:
        """The record's ``case``."""
        return self.case.to_record(self.case_id)

    def non_ok_record(self, status: str, reason: str, **extra):
        """A record of this launch that measured nothing (:func:`slapo_ae.record.non_ok`)."""
        import os

        from slapo_ae import gpus
        from slapo_ae.record import collect_env, iso, non_ok

        device = gpus.describe(self.case.device, self.case.gpus,
                               os.environ.get("CUDA_VISIBLE_DEVICES"))
        return non_ok(self.case_dict(), status, reason, log_path=self.log,
                      started_at=iso(self.launch_time),
                      env={**collect_env(device), **self.thread_budget().as_env_record(),
                           "memory_per_rank": self.memory_per_rank},
                      extra={"run_id": self.run_id, "dtype": self.case.dtype,
                             "device": self.case.device, **extra})

    def thread_budget(self) -> ThreadBudget:
        """How the case's cores are shared by its ranks (:mod:`slapo_ae.harness.threads`)."""
        ranks = self.case.gpus_per_node  # the ranks on this machine
        return ThreadBudget.for_case(self.cores or default_cores(self.case.device, ranks), ranks)

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        data["case"] = json.loads(self.case.to_json(with_origin=True))  # the case's encoding
        return json.dumps(data)

    @classmethod
    def from_json(cls, text: str) -> RunSpec:
        data = json.loads(text)
        return cls(**{**data, "case": Case.from_json(json.dumps(data["case"]))})
