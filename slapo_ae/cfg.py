"""Benchmark cases: the cfg file format, one case a line (docs/harness.md).

A line reads ``MODE MODEL GPUS SEQ_LEN DEC_SEQ_LEN BATCH_SIZE CKPT``; tokens are split like a
shell does (:mod:`shlex`), so a batch expression with spaces is quoted. A ``#`` starts a
comment (outside quotes); blank lines are skipped. One line gives one :class:`Case` per GPU
count:

- GPUS: one number, a comma list (``2,4,8``), or ``pow2`` (1, 2, 4, ... up to ``max_gpus``).
- SEQ_LEN: with ``known_models`` (the workflow, ``slapo-bench cases``), at most the model's
  learned positions (:func:`slapo_ae.zoo.configs.max_seq_len`).
- BATCH_SIZE: the *global* batch, an expression of the GPU count ``n`` (:mod:`slapo_ae.expr`).
- CKPT: activation checkpointing. ``megatron``: ``full``, ``selective`` or ``0`` (none, stored
  as ``None``). Every other mode: the fraction of layers checkpointed, a float in [0, 1]
  (for ``deepspeed`` the paper's 1 means HF gradient checkpointing on).

After the seven fields a line may carry ``key=value`` tokens, for ``megatron`` and
``slapo-megatron`` only (3D parallelism, :class:`slapo_ae.case.Case`): ``pp=P`` pipeline
stages (default 1), ``tp=T`` tensor-parallel ranks per stage (default GPUS / P, no data
parallelism) and ``micro=M`` samples per micro-batch (with P > 1; default the replica's batch
/ P). The remaining GPUs are data-parallel replicas, ``dp = GPUS / (P * T)``; a product that
does not divide is an error of the line. For example
``slapo-megatron llama-7b 16 1024 0 256 0 pp=2 tp=8 micro=4``.

Modes (:data:`slapo_ae.case.MODES`) are the four systems of Figure 7, the original benchmark's
``eager`` and ``torchscript``, the Slapo steps of the Figure 9 ablation on top of ``eager``
(Vanilla), and the HF baselines ``hf-sdpa``, ``hf-compile`` and ``hf-liger`` a user would
pick instead of Slapo.
"""
from __future__ import annotations

import difflib
import re
import shlex
from pathlib import Path

from slapo_ae import expr as _expr
from slapo_ae import textfile
from slapo_ae.case import MAX_GPUS, Case, CaseError, check_batch, check_mode, parse_ckpt
from slapo_ae.zoo import configs

FIELDS = ("MODE", "MODEL", "GPUS", "SEQ_LEN", "DEC_SEQ_LEN", "BATCH_SIZE", "CKPT")
# the optional key=value tokens after the fields, and the Case field each sets
OPTIONS = {"pp": "pp", "tp": "tp", "micro": "micro_batch"}


class CfgError(ValueError):
    """A malformed cfg file; ``errors`` lists each problem as ``file:line: message``."""

    def __init__(self, errors: list[str]):
        self.errors = list(errors)
        super().__init__("\n".join(self.errors))


def expand_gpus(spec: str, max_gpus: int | None = None) -> list[int]:
    """GPU counts of a GPUS field: ``"8"`` -> [8]; ``"2,4,8"`` -> [2, 4, 8];
    ``"pow2"`` -> [1, 2, 4, ...] up to ``max_gpus`` (required then). Explicit counts are
    kept as written, even above ``max_gpus``: skipping them is the caller's choice."""
    spec = spec.strip()
    if spec == "pow2":
        if max_gpus is None:
            raise ValueError("GPUS 'pow2' needs max_gpus (the GPUs present)")
        if not 1 <= max_gpus <= MAX_GPUS:
            raise ValueError(f"max_gpus must be 1 to {MAX_GPUS}, got {max_gpus}")
        return [2**i for i in range(max_gpus.bit_length()) if 2**i <= max_gpus]
    counts = []
    for item in spec.split(","):
        item = item.strip()
        if not re.fullmatch(r"[0-9]+", item) or int(item) < 1:
            raise ValueError(f"GPUS {spec!r}: {item!r} is not a positive integer (or use pow2)")
        if int(item) > MAX_GPUS:
            raise ValueError(f"GPUS {spec!r}: {item} is more than {MAX_GPUS}")
        if int(item) in counts:
            raise ValueError(f"GPUS {spec!r}: {item} is listed twice")
        counts.append(int(item))
    return counts


def _int_field(name: str, token: str, minimum: int) -> int:
    if not re.fullmatch(r"[0-9]+", token):
        raise ValueError(f"{name} {token!r} is not an integer")
    if int(token) < minimum:
        raise ValueError(f"{name} {token!r} must be at least {minimum}")
    return int(token)


def _parse_options(tokens: list[str]) -> dict[str, int]:
    """The ``key=value`` tokens after the fields -> Case fields (:data:`OPTIONS`)."""
    options = {}
    for token in tokens:
        key, sep, value = token.partition("=")
        if key not in OPTIONS:
            known = ", ".join(f"{k}=" for k in OPTIONS)
            raise ValueError(f"unknown option {token!r} after the {len(FIELDS)} fields "
                             f"(known: {known})")
        if OPTIONS[key] in options:
            raise ValueError(f"option {key}= is given twice")
        options[OPTIONS[key]] = _int_field(f"{key}=", value, 1)
    return options


def _parse_line(tokens: list[str], source: str, lineno: int, max_gpus, known_models):
    extra = tokens[len(FIELDS):]
    if len(tokens) < len(FIELDS) or any("=" not in token for token in extra):
        raise ValueError(f"expected {len(FIELDS)} fields ({' '.join(FIELDS)}), then optional "
                         f"key=value tokens ({', '.join(f'{k}=' for k in OPTIONS)}); "
                         f"got {len(tokens)}: {tokens}")
    mode, model, gpus, seq, dec, batch, ckpt = tokens[:len(FIELDS)]
    check_mode(mode)
    if known_models is not None and model not in known_models:
        near = difflib.get_close_matches(model, list(known_models), n=3, cutoff=0.5)
        hint = f"; close matches: {', '.join(near)}" if near else ""
        raise ValueError(f"unknown model {model!r}{hint}")
    counts = expand_gpus(gpus, max_gpus)
    seq_len = _int_field("SEQ_LEN", seq, 1)
    if known_models is not None:
        configs.check_seq_len(model, seq_len)
    dec_seq_len = _int_field("DEC_SEQ_LEN", dec, 0)
    if known_models is not None:
        configs.check_dec_seq_len(model, dec_seq_len)
    ckpt_value = parse_ckpt(mode, ckpt)
    options = _parse_options(extra)
    cases = []
    for n in counts:
        try:
            batch_size = _expr.batch_size(batch, n)
        except _expr.ExpressionError as err:
            raise ValueError(f"BATCH_SIZE: {err}") from None
        try:
            check_batch(mode, batch_size, n)
        except CaseError as err:
            raise ValueError(f"BATCH_SIZE {batch!r} {err}") from None
        try:
            cases.append(Case(mode=mode, model=model, gpus=n, seq_len=seq_len,
                              dec_seq_len=dec_seq_len, batch_size=batch_size, batch_expr=batch,
                              ckpt=ckpt_value, source=source, line=lineno, **options))
        except CaseError as err:
            at = f" (at {n} GPUs)" if len(counts) > 1 else ""
            raise ValueError(f"{err}{at}") from None
    return cases


def parse_cfg_text(text: str, source: str = "<string>", max_gpus: int | None = None,
                   known_models=None) -> list[Case]:
    """Parse cfg text; raise one :class:`CfgError` listing every bad line as ``source:line``."""
    cases, errors, seen = [], [], {}
    # lines end at "\n" only (a "\r" before it is whitespace): str.splitlines would also
    # break at a form feed or U+2028 inside a line and shift every later line number
    for lineno, raw in enumerate(text.split("\n"), start=1):
        if not raw.strip() or raw.lstrip().startswith("#"):
            continue
        try:
            tokens = shlex.split(raw, comments=True)
            if not tokens:
                continue
            line_cases = _parse_line(tokens, source, lineno, max_gpus, known_models)
        except ValueError as err:
            errors.append(f"{source}:{lineno}: {err}")
            continue
        for case in line_cases:
            if case.id in seen:
                errors.append(f"{source}:{lineno}: duplicate case {case.id} "
                              f"(first at {source}:{seen[case.id]})")
            else:
                seen[case.id] = lineno
                cases.append(case)
    if errors:
        raise CfgError(errors)
    return cases


def parse_cfg(path, max_gpus: int | None = None, known_models=None) -> list[Case]:
    """Parse the cfg file at ``path`` into cases, in file order (a file that is not UTF-8
    text is a :class:`CfgError` naming the byte where decoding failed; ``OSError`` if it cannot
    be read)."""
    path = Path(path)
    try:
        text = textfile.read_text(path)
    except textfile.NotTextError as err:
        raise CfgError([str(err)]) from None
    return parse_cfg_text(text, str(path), max_gpus, known_models)


def to_cfg_line(case: Case) -> str:
    """The cfg line that parses back to ``case`` (one GPU count; source and line aside)."""
    batch = case.batch_expr
    if shlex.quote(batch) != batch:
        batch = f'"{batch}"'
    given = {"pp": case.pp if case.pp != 1 else None, "tp": case.tp, "micro": case.micro_batch}
    options = [f"{key}={value}" for key, value in given.items() if value is not None]
    return " ".join([case.mode, case.model, str(case.gpus), str(case.seq_len),
                     str(case.dec_seq_len), batch, case.ckpt_token, *options])
