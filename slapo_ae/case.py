"""One benchmark case and its one encoding.

A :class:`Case` is what one measurement is: a system (``mode``) training a model on ``gpus``
GPUs (ranks on a CPU machine) with a global batch, sequence lengths and activation
checkpointing, and the run settings that shape the result (steps, warm-up, dtype, device,
seed, learning rate, dropout, model-config overrides). A cfg line (:mod:`slapo_ae.cfg`) gives
cases without run settings; :meth:`Case.for_run` adds them.

Every part of the artifact passes a case in one of three forms, all defined here:

- JSON (:meth:`to_json` / :meth:`from_json`): the workflow job's ``params`` and the runner's
  ``--case``; a changed field reruns the job, a moved cfg line does not (no source or line);
  the launcher's ``--spec`` to the ranks (:mod:`slapo_ae.harness.runspec`) keeps them;
- argv (:meth:`to_argv`, parsed back by :func:`add_arguments` and :func:`from_args`): the
  ``slapo-bench run`` call of the case runner, the GPU check and a user;
- the record's ``case`` (:meth:`to_record`), which the analysis reads.

3D parallelism (``megatron`` and ``slapo-megatron`` only): ``pp`` pipeline stages, ``tp``
tensor-parallel ranks inside a stage (``None``: ``gpus // pp``, no data parallelism) and
``micro_batch`` samples per micro-batch (``None``: the replica's batch in ``pp`` parts); the
rest of the GPUs are data-parallel replicas, ``dp = gpus // (pp * tp)``. A cfg line gives them
as ``pp=P tp=T micro=M`` (:mod:`slapo_ae.cfg`), ``slapo-bench run`` as ``--pp``, ``--tp``,
``--micro-batch``; only values given change the case's id and encodings, so the cases written
before 3D parallelism keep theirs.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re

from slapo_ae import expr

MODES = {
    "megatron": "Megatron-LM (megatron-core) baseline, tensor parallelism = GPUs",
    "slapo-megatron": "HF model + Slapo schedule, tensor parallelism on Megatron (Slapo-TP)",
    "deepspeed": "HF model on DeepSpeed ZeRO-3, micro-batch = batch / GPUs",
    "slapo-deepspeed": "HF model + Slapo schedule on DeepSpeed ZeRO-3 (Slapo-ZeRO3)",
    "eager": "the HF model as is, data parallel (Figure 9: Vanilla)",
    "hf-sdpa": "the HF model with HF's SDPA attention, data parallel (a one-GPU baseline)",
    "hf-compile": "the HF model (SDPA) under torch.compile, data parallel (a one-GPU baseline)",
    "hf-liger": "the HF model (SDPA) with liger-kernel's kernels, data parallel (GPU only)",
    "torchscript": "original benchmark's TorchScript mode; parsed, reported unsupported",
    "slapo-kernel": "Figure 9 '+ Kernel Opt': fused attention and bias+GeLU kernels",
    "slapo-tp-attn-ffn": "Figure 9 '+ Attn/FFN TP': kernels + TP of attention and FFN",
    "slapo-tp-full": "Figure 9 '+ Embedding TP': kernels + TP incl. the word embedding",
}
# Modes whose GPUs are all data-parallel ranks: each takes batch / GPUs samples
DATA_PARALLEL_MODES = ("eager", "hf-sdpa", "hf-compile", "hf-liger", "slapo-kernel",
                       "deepspeed", "slapo-deepspeed")
# Modes whose GPUs are tensor-parallel ranks (with pp = 1 and no tp given, all of them)
TENSOR_PARALLEL_MODES = ("megatron", "slapo-megatron", "slapo-tp-full", "slapo-tp-attn-ffn")
# Modes that take the 3D settings pp, tp, micro_batch
PIPELINE_MODES = ("megatron", "slapo-megatron")
MEGATRON_CKPT = ("full", "selective")
DTYPES = ("fp32", "fp16", "bf16")
MAX_GPUS = 65536  # larger counts are typos; the launcher bounds CPU ranks by the machine
MAX_STEPS = 1_000_000  # larger counts are typos (days of steps even for a tiny model)
MAX_MEMORY_PER_RANK = 2**43 - 1  # MiB: the most RLIMIT_DATA (bytes, 64 bits) holds
DEFAULT_LR = 1e-4
DEFAULT_SEED = 1234
# The record's case fields; tp, dp and micro_batch are the effective values (defaults
# resolved), which Case names tp_size, dp_size and micro_batch_size.
RECORD_FIELDS = ("mode", "model", "gpus", "nodes", "gpus_per_node", "pp", "tp", "dp",
                 "micro_batch", "seq_len", "dec_seq_len", "batch_size", "batch_expr", "ckpt",
                 "source", "line")
_EFFECTIVE = {"tp": "tp_size", "dp": "dp_size", "micro_batch": "micro_batch_size"}


class CaseError(ValueError):
    """A case field that is out of range or malformed (the message names the field)."""


@dataclasses.dataclass(frozen=True)
class Case:
    """One benchmark case; ``batch_size`` is the global batch, ``steps`` count every step and
    the first ``warmup`` of them are left out of the throughput."""

    mode: str
    model: str
    gpus: int
    seq_len: int
    dec_seq_len: int
    batch_size: int  # evaluated from batch_expr at n = gpus
    batch_expr: str
    ckpt: str | float | None  # megatron: "full" | "selective" | None; else ratio in [0, 1]
    steps: int | None = None  # run settings: None until for_run
    warmup: int | None = None
    dtype: str = "fp32"
    device: str = "cpu"
    seed: int = DEFAULT_SEED
    lr: float = DEFAULT_LR
    no_dropout: bool = False
    overrides: dict = dataclasses.field(default_factory=dict, hash=False)  # model config fields
    nodes: int = 1  # machines the GPUs are spread over, gpus_per_node each
    pp: int = 1  # pipeline stages (megatron, slapo-megatron)
    tp: int | None = None  # tensor-parallel ranks per stage; None: gpus // pp
    micro_batch: int | None = None  # samples per micro-batch; None: replica's batch / pp
    memory_per_rank: int | None = None  # MiB of data each rank may hold (RLIMIT_DATA), if capped
    # where the case was written; not part of what is measured
    source: str = dataclasses.field(default="", compare=False)
    line: int = dataclasses.field(default=0, compare=False)

    def __post_init__(self):
        if not isinstance(self.nodes, int) or self.nodes < 1:
            raise CaseError(f"nodes must be a positive integer, got {self.nodes!r}")
        if self.gpus % self.nodes:
            raise CaseError(f"{self.gpus} GPUs do not spread evenly over {self.nodes} nodes")
        check_parallelism(self.mode, self.gpus, self.batch_size, self.pp, self.tp,
                          self.micro_batch)
        if self.overrides:  # wherever they come from: refused before anything runs
            from slapo_ae.zoo.configs import check_overrides

            try:
                check_overrides(self.model, self.overrides)
            except KeyError as err:
                raise CaseError(err.args[0]) from None
            except ValueError as err:
                raise CaseError(str(err)) from None

    @property
    def gpus_per_node(self) -> int:
        return self.gpus // self.nodes

    @property
    def tp_size(self) -> int:
        """Tensor-parallel ranks per stage: ``tp`` if given; else all of a stage's GPUs in a
        tensor-parallel mode, 1 in the others."""
        if self.tp is not None:
            return self.tp
        return self.gpus // self.pp if self.mode in TENSOR_PARALLEL_MODES else 1

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas: ``gpus // (pp * tp)``."""
        return self.gpus // (self.pp * self.tp_size)

    @property
    def micro_batch_size(self) -> int:
        """Samples per micro-batch: ``micro_batch`` if given, else the replica's batch split
        into ``pp`` micro-batches (with pp = 1, the replica's whole batch)."""
        if self.micro_batch is not None:
            return self.micro_batch
        return self.batch_size // (self.dp_size * self.pp)

    @property
    def n_microbatches(self) -> int:
        """Micro-batches of one step on each replica."""
        return self.batch_size // self.dp_size // self.micro_batch_size

    @property
    def is_3d(self) -> bool:
        """A ``megatron``/``slapo-megatron`` case with pipeline stages or data-parallel
        replicas beside its tensor parallelism: it runs under the mode's 3D system."""
        return self.mode in PIPELINE_MODES and (self.pp > 1 or self.dp_size > 1)

    @property
    def ckpt_token(self) -> str:
        """CKPT as written in a cfg file (``0`` for none, ``1`` for 1.0, ``0.67``, ``full``)."""
        if self.ckpt is None:
            return "0"
        if isinstance(self.ckpt, str):
            return self.ckpt
        text = repr(float(self.ckpt))
        return text[:-2] if text.endswith(".0") else text

    @property
    def id(self) -> str:
        """Stable, filesystem-safe name, e.g. ``slapo-megatron__bert-xlarge__g2__s512__b56__c0``."""
        parts = [self.mode, safe_name(self.model), f"g{self.gpus}"]
        if self.nodes > 1:
            parts.append(f"n{self.nodes}")
        if self.pp != 1:
            parts.append(f"p{self.pp}")
        if self.tp is not None:
            parts.append(f"t{self.tp}")
        if self.micro_batch is not None:
            parts.append(f"m{self.micro_batch}")
        parts.append(f"s{self.seq_len}")
        if self.dec_seq_len:
            parts.append(f"d{self.dec_seq_len}")
        parts += [f"b{self.batch_size}", f"c{self.ckpt_token}"]
        return "__".join(parts)

    @property
    def where(self) -> str:
        return f"{self.source}:{self.line}"

    def for_run(self, steps: int, warmup: int, dtype: str, device: str) -> Case:
        """The case as a job runs it: with run settings, the batch as its value (editing the
        expression but not its value reruns nothing), and no source or line."""
        return dataclasses.replace(self, steps=int(steps), warmup=int(warmup), dtype=dtype,
                                   device=device, batch_expr=str(self.batch_size), source="",
                                   line=0)

    # -- encodings ---------------------------------------------------------------------
    def to_json(self, with_origin: bool = False) -> str:
        """The case as JSON; ``with_origin`` keeps where it was written (``source``,
        ``line``), which the launcher hands to the ranks for the record's ``case``."""
        data = dataclasses.asdict(self)
        if not with_origin:
            del data["source"], data["line"]
        # settings left at their defaults are left out: the encoding (and so the workflow's
        # jobs) of a case on one node without 3D settings or a memory cap is what it was before them
        for name, default in (("nodes", 1), ("pp", 1), ("tp", None), ("micro_batch", None),
                              ("memory_per_rank", None)):
            if data[name] == default:
                del data[name]
        return json.dumps(data, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Case:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise CaseError(f"a case is a JSON object, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise CaseError(f"unknown case field(s): {', '.join(unknown)}")
        try:
            return cls(**data)
        except TypeError as err:
            raise CaseError(str(err)) from None

    def to_argv(self) -> list[str]:
        """The ``slapo-bench run`` options of this case (:func:`add_arguments` reads them)."""
        if self.steps is None or self.warmup is None:
            raise CaseError(f"{self.id}: no run settings (steps, warm-up); use for_run")
        argv = ["--mode", self.mode, "--model", self.model, "--gpus", str(self.gpus),
                "--seq-len", str(self.seq_len), "--dec-seq-len", str(self.dec_seq_len),
                "--batch-size", str(self.batch_size), "--ckpt", self.ckpt_token,
                "--steps", str(self.steps), "--warmup", str(self.warmup),
                "--dtype", self.dtype, "--device", self.device, "--seed", str(self.seed),
                "--lr", repr(float(self.lr))]
        if self.no_dropout:
            argv.append("--no-dropout")
        if self.nodes > 1:
            argv += ["--nodes", str(self.nodes)]
        if self.pp != 1:
            argv += ["--pp", str(self.pp)]
        if self.tp is not None:
            argv += ["--tp", str(self.tp)]
        if self.micro_batch is not None:
            argv += ["--micro-batch", str(self.micro_batch)]
        if self.memory_per_rank is not None:
            argv += ["--memory-per-rank", str(self.memory_per_rank)]
        for key, value in self.overrides.items():
            argv += ["--override", f"{key}={json.dumps(value)}"]
        return argv

    def to_record(self, case_id: str | None = None) -> dict:
        """The record's ``case``: the cfg fields, where it was written, and its id."""
        data = {name: getattr(self, _EFFECTIVE.get(name, name)) for name in RECORD_FIELDS}
        return {"id": case_id or self.id, **data}


def safe_name(model: str) -> str:
    """A model name usable in a file name: ``EleutherAI/gpt-neo-2.7B`` ->
    ``EleutherAI--gpt-neo-2.7B``."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", model.replace("/", "--"))


def parse_ckpt(mode: str, token: str) -> str | float | None:
    """CKPT field -> ``Case.ckpt`` for ``mode``: ``megatron`` takes ``full``, ``selective`` or
    ``0`` (none, stored as ``None``); every other mode a ratio of layers in [0, 1]."""
    if mode == "megatron":
        if token in MEGATRON_CKPT:
            return token
        if token in ("0", "0.0", "none"):
            return None
        raise CaseError(f"CKPT {token!r}: megatron takes 'full', 'selective' or 0 "
                        "(write 'full' for the paper's 1)")
    if token in MEGATRON_CKPT:
        raise CaseError(f"CKPT {token!r} is a Megatron setting; {mode} takes a ratio in [0, 1]")
    try:
        ratio = float(token)
    except ValueError:
        raise CaseError(f"CKPT {token!r} is not a number (a ratio in [0, 1])") from None
    if not 0.0 <= ratio <= 1.0:
        raise CaseError(f"CKPT {token!r} is out of [0, 1]")
    return ratio


def check_batch(mode: str, batch_size: int, gpus: int) -> None:
    """A data-parallel mode splits the global batch evenly over its GPUs."""
    if mode in DATA_PARALLEL_MODES and batch_size % gpus:
        raise CaseError(f"gives {batch_size} for {gpus} GPUs, not divisible: {mode} splits the "
                        "global batch over its data-parallel ranks")


def check_parallelism(mode: str, gpus: int, batch_size: int, pp: int = 1, tp: int | None = None,
                      micro_batch: int | None = None) -> None:
    """The 3D settings fit the case: only ``megatron`` and ``slapo-megatron`` take them,
    ``pp * tp`` divides the GPUs, the replicas split the global batch evenly and the
    micro-batch divides a replica's share. Messages use the cfg tokens' names."""
    for name, value in (("pp", pp), ("tp", tp), ("micro", micro_batch)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value < 1):
            raise CaseError(f"{name}={value!r}: must be a positive integer")
    given = {"pp": pp if pp != 1 else None, "tp": tp, "micro": micro_batch}
    if mode not in PIPELINE_MODES:
        named = [f"{name}={value}" for name, value in given.items() if value is not None]
        if named:
            raise CaseError(f"{' '.join(named)}: pipeline/tensor/micro-batch settings are for "
                            f"{' and '.join(PIPELINE_MODES)}, not {mode}")
        return
    if tp is None:
        if gpus % pp:
            raise CaseError(f"pp={pp} does not divide the {gpus} GPUs")
        tp = gpus // pp
    elif gpus % (pp * tp):
        raise CaseError(f"pp={pp} x tp={tp} = {pp * tp} does not divide the {gpus} GPUs")
    dp = gpus // (pp * tp)
    if batch_size % dp:
        raise CaseError(f"the global batch {batch_size} does not split over {dp} data-parallel "
                        f"replicas ({gpus} GPUs / (pp={pp} x tp={tp}))")
    share = batch_size // dp
    if micro_batch is not None:
        if pp == 1:
            raise CaseError(f"micro={micro_batch} needs pp > 1: micro-batches feed the "
                            "pipeline's stages")
        if share % micro_batch:
            raise CaseError(f"micro={micro_batch} does not divide a replica's batch {share} "
                            f"(global {batch_size} / {dp} replicas)")
    elif share % pp:
        raise CaseError(f"a replica's batch {share} (global {batch_size} / {dp} replicas) does "
                        f"not split into pp={pp} micro-batches; give micro=")


def check_mode(mode: str) -> None:
    if mode not in MODES:
        import difflib

        near = difflib.get_close_matches(mode, MODES, n=3)
        hint = f" (did you mean {', '.join(near)}?)" if near else ""
        raise CaseError(f"unknown mode {mode!r}{hint}; known: {', '.join(MODES)}")


# -- argv ------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The case's options of ``slapo-bench run`` (what :meth:`Case.to_argv` writes)."""
    parser.add_argument("--mode", required=True, help=f"one of: {', '.join(MODES)}")
    parser.add_argument("--model", required=True, help="model name of configs/models")
    parser.add_argument("--gpus", type=int, required=True,
                        help="GPUs in all (ranks on a CPU machine)")
    parser.add_argument("--nodes", type=int, default=1,
                        help="machines the GPUs are spread over (GPUS / NODES each); run the "
                             "same command on each, with --rdzv-endpoint")
    parser.add_argument("--pp", type=int, default=1,
                        help="megatron, slapo-megatron: pipeline stages (default 1)")
    parser.add_argument("--tp", type=int, default=None,
                        help="megatron, slapo-megatron: tensor-parallel ranks per stage "
                             "(default GPUS / PP: no data parallelism)")
    parser.add_argument("--micro-batch", type=int, default=None,
                        help="megatron, slapo-megatron with --pp > 1: samples per micro-batch "
                             "(default: a replica's batch / PP)")
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--dec-seq-len", type=int, default=0)
    parser.add_argument("--batch-size", required=True,
                        help="global batch: an integer or an expression in n (the GPU count)")
    parser.add_argument("--ckpt", default="0",
                        help="megatron: full | selective | 0; others: ratio of layers in [0, 1]")
    parser.add_argument("--steps", type=int, required=True, help="all steps, warm-up included")
    parser.add_argument("--warmup", type=int, required=True,
                        help="leading steps left out of the throughput")
    parser.add_argument("--dtype", choices=DTYPES, default="fp32",
                        help="fp32 (default; the only one on CPU), or 16-bit mixed precision "
                             "on GPU")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED,
                        help="weights and synthetic data (same on every rank)")
    parser.add_argument("--lr", type=float, default=DEFAULT_LR, help="AdamW learning rate")
    parser.add_argument("--no-dropout", action="store_true",
                        help="switch every dropout off (for loss comparisons; the paper trains "
                             "with the models' dropout)")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="model config field (VALUE parsed as JSON when it can be)")
    parser.add_argument("--memory-per-rank", type=int, default=None, metavar="MIB",
                        help="cap the data each rank may hold (RLIMIT_DATA): an allocation past "
                             "it fails and the case is recorded as oom (on CPU, where nothing "
                             "else bounds a rank's memory)")


def parse_override(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise CaseError(f"--override {text!r}: expected KEY=VALUE")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def parse_overrides(texts) -> dict:
    """``--override KEY=VALUE`` options as a dict; a key given twice is an error."""
    overrides = {}
    for text in texts:
        key, value = parse_override(text)
        if key in overrides:
            raise CaseError(f"--override {key} is given twice ({overrides[key]!r}, {value!r})")
        overrides[key] = value
    return overrides


def from_args(args: argparse.Namespace, device: str, source: str = "slapo-bench run") -> Case:
    """The :class:`Case` of parsed ``slapo-bench run`` options (``device`` resolved from
    ``--device auto`` by the caller); :class:`CaseError` names the bad option."""
    check_mode(args.mode)
    if not 1 <= args.gpus <= MAX_GPUS:
        raise CaseError(f"--gpus must be 1 to {MAX_GPUS}, got {args.gpus}")
    if args.seq_len < 1 or args.dec_seq_len < 0:
        raise CaseError("--seq-len must be >= 1 and --dec-seq-len >= 0")
    if args.warmup < 0 or args.steps <= args.warmup:
        raise CaseError(f"--steps ({args.steps}) must exceed --warmup ({args.warmup}) >= 0: "
                        "steps count every step, warm-up ones included")
    if args.steps > MAX_STEPS:
        raise CaseError(f"--steps must be at most {MAX_STEPS}, got {args.steps}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise CaseError(f"--lr must be a positive number, got {args.lr}")
    if not 0 <= args.seed < 2**63:  # torch.manual_seed's range
        raise CaseError(f"--seed must be 0 to 2**63 - 1, got {args.seed}")
    if args.nodes < 1 or args.gpus % args.nodes:
        raise CaseError(f"--nodes {args.nodes}: the {args.gpus} GPUs must spread evenly over "
                        "at least one node")
    try:
        batch = expr.batch_size(args.batch_size, args.gpus)
        check_batch(args.mode, batch, args.gpus)
    except (expr.ExpressionError, CaseError) as err:
        raise CaseError(f"--batch-size {args.batch_size!r}: {err}") from None
    try:
        ckpt = parse_ckpt(args.mode, args.ckpt)
    except CaseError as err:
        raise CaseError(f"--ckpt: {err}") from None
    try:
        check_parallelism(args.mode, args.gpus, batch, args.pp, args.tp, args.micro_batch)
    except CaseError as err:
        raise CaseError(f"--pp/--tp/--micro-batch: {err}") from None
    if args.memory_per_rank is not None and args.memory_per_rank < 1:
        raise CaseError(f"--memory-per-rank must be a positive number of MiB, got "
                        f"{args.memory_per_rank}")
    if args.memory_per_rank is not None and args.memory_per_rank > MAX_MEMORY_PER_RANK:
        raise CaseError(f"--memory-per-rank must be at most {MAX_MEMORY_PER_RANK} MiB, got "
                        f"{args.memory_per_rank}")
    return Case(mode=args.mode, model=args.model, gpus=args.gpus, seq_len=args.seq_len,
                dec_seq_len=args.dec_seq_len, batch_size=batch, batch_expr=args.batch_size,
                ckpt=ckpt, steps=args.steps, warmup=args.warmup, dtype=args.dtype,
                device=device, seed=args.seed, lr=args.lr, no_dropout=args.no_dropout,
                overrides=parse_overrides(args.override), nodes=args.nodes,
                pp=args.pp, tp=args.tp, micro_batch=args.micro_batch,
                memory_per_rank=args.memory_per_rank, source=source)
