"""What one harness run does: the case plus the run settings, passed from the parent to the ranks.

The parent (``slapo-bench run``) builds a :class:`RunSpec` from its command line, checks it,
and hands it to every rank as one JSON argument (``python -m slapo.bench.worker --spec JSON``).
The module imports neither torch nor a model library.
"""
from __future__ import annotations

import dataclasses
import json

from slapo.bench.cases import Case
from slapo.bench.threads import ThreadBudget, default_cores

DTYPES = ("fp32", "fp16", "bf16")
DEVICES = ("cpu", "cuda")
DEFAULT_LR = 1e-4
DEFAULT_SEED = 1234
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
    """A case and how to run it. ``steps`` counts every step; the first ``warmup`` of them are
    excluded from throughput. ``batch_size`` is the global batch."""

    mode: str
    model: str
    gpus: int
    seq_len: int
    dec_seq_len: int
    batch_size: int
    batch_expr: str
    ckpt: str | float | None
    steps: int
    warmup: int
    dtype: str
    device: str
    out: str
    log: str | None = None
    timeout: float | None = None
    case_id: str | None = None
    seed: int = DEFAULT_SEED
    lr: float = DEFAULT_LR
    no_dropout: bool = False
    overrides: dict = dataclasses.field(default_factory=dict)  # model config fields
    cores: int | None = None  # CPU cores the case holds, shared by its ranks (threads.py)
    profile_dir: str | None = None  # where each rank writes its torch.profiler tables
    run_id: str = ""  # ties the record rank 0 writes to this launch
    launch_time: float | None = None  # parent's time.time() just before starting torchrun
    rundir: str | None = None  # where ranks leave their status files

    def case(self) -> Case:
        return Case(self.mode, self.model, self.gpus, self.seq_len, self.dec_seq_len,
                    self.batch_size, self.batch_expr, self.ckpt, source="slapo-bench run")

    def case_dict(self) -> dict:
        """The record's ``case``: the :class:`Case` fields, ``id`` as given by ``--case-id``."""
        data = self.case().to_dict()
        if self.case_id:
            data["id"] = self.case_id
        return data

    def thread_budget(self) -> ThreadBudget:
        """How the case's cores are shared by its ranks (:mod:`slapo.bench.threads`)."""
        return ThreadBudget.for_case(self.cores or default_cores(self.device, self.gpus),
                                     self.gpus)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "RunSpec":
        return cls(**json.loads(text))
