"""What the workflow runs: the active profile, its cases, and the files each case depends on.

Imported by ``workflow/rules/common.smk`` while Snakemake builds the DAG, so it stays light:
no torch, no pandas, no model building (a model's family is read from its JSON config).

Profiles (``configs/config.yaml``, key ``profiles``) name the cfg files of each experiment and
the run settings (device, dtype, steps, warm-up, timeout). ``profile: auto`` picks one from the
GPUs visible (:func:`detect_gpus`): none -> ``cpu``, 1 to 7 -> ``gpu1``, 8 or more -> ``paper``
(:func:`auto_profile`).

Rerun semantics (what Snakemake sees of a case):

- the case's fields and the profile's run settings are the job's ``params``
  (:func:`case_spec`), not the cfg file, so editing one cfg line reruns only the cases of that
  line (and the aggregates that read them);
- the code a case runs is its ``input`` (:func:`case_inputs`): the harness, the schedule
  language, the model zoo and the model's JSON config for every case, and for the Slapo modes
  also the shared modules of ``slapo/model_schedule`` (``__init__.py``, ``common.py``) and the
  schedule file of the model's family (with any sibling it imports), so that editing
  ``bert.py`` reruns the BERT cases of Slapo modes and nothing else.
"""
from __future__ import annotations

import ast
import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from slapo.bench.cases import Case, CfgError, parse_cfg, parse_cfg_text  # noqa: F401

EXPERIMENTS = ("e2e", "ablation")
PROFILE_BY_GPUS = ((8, "paper"), (1, "gpu1"), (0, "cpu"))  # (at least this many GPUs, profile)

# Modules of slapo/bench that only analyse records: editing them reruns the aggregates, never
# a case. Everything else under slapo/ (but slapo/model_schedule) is code a case runs.
ANALYSIS_MODULES = ("aggregate.py", "plots.py", "table4.py", "claims.py", "gaps.py")
ANALYSIS_DIRS = ("workflow",)
CASE_RUNNER = ("workflow/__init__.py", "workflow/run_case.py", "workflow/gpu_slots.py")
SCHEDULE_DIR = "slapo/model_schedule"
# The families of the model zoo (slapo.models.FAMILIES) and their schedule file names; the
# first name that exists is the family's schedule. Every other module of slapo/model_schedule
# (its __init__, shared helpers) is code all Slapo modes run, except the Table 4 line counter.
FAMILY_FILES = {
    "bert": ("bert.py",), "roberta": ("roberta.py",), "gpt_neo": ("gpt_neo.py", "gpt.py"),
    "opt": ("opt.py",), "t5": ("t5.py",), "llama": ("llama.py",),
    "wideresnet": ("wideresnet.py", "wide_resnet.py"),
}
SCHEDULE_NOT_RUN = ("loc.py",)


class PlanError(ValueError):
    """A config or cfg problem found while planning the DAG (message names the file)."""


# ----------------------------------------------------------------------------- GPUs, profile

def detect_gpus(env: dict | None = None, timeout: float = 10.0) -> int:
    """GPUs visible to this process, without importing torch.

    ``CUDA_VISIBLE_DEVICES`` wins when set (empty or ``-1`` means none); otherwise the lines
    ``GPU i: ...`` of ``nvidia-smi -L``; 0 when there is no ``nvidia-smi`` or it fails.
    """
    env = os.environ if env is None else env
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [v for v in visible.split(",") if v.strip()]
        return 0 if not ids or ids[0].strip() == "-1" else len(ids)
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return 0
    if out.returncode:
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def auto_profile(gpus: int) -> str:
    """The profile ``profile: auto`` picks for ``gpus`` visible GPUs."""
    for minimum, name in PROFILE_BY_GPUS:
        if gpus >= minimum:
            return name
    return "cpu"


def resolve(config: dict, env: dict | None = None) -> dict:
    """The settings of the active profile, completed: ``{"name", "gpus_available", "device",
    "dtype", "steps", "warmup", "timeout", "max_gpus", "experiments": {exp: [cfg, ...]}}``.

    ``config["gpus"]``: ``"auto"`` (detect) or a number; ``config["profile"]``: ``"auto"`` or
    a key of ``config["profiles"]``.
    """
    gpus = config.get("gpus", "auto")
    gpus = detect_gpus(env) if gpus in ("auto", None) else int(gpus)
    name = config.get("profile", "auto")
    name = auto_profile(gpus) if name in ("auto", None) else str(name)
    profiles = config.get("profiles", {})
    if name not in profiles:
        raise PlanError(f"profile {name!r} is not defined in the config; "
                        f"defined: {', '.join(sorted(profiles))}")
    settings = dict(profiles[name])
    settings["name"] = name
    settings["gpus_available"] = gpus
    settings.setdefault("max_gpus", max(gpus, 1))
    settings["experiments"] = {exp: list(settings.get("experiments", {}).get(exp, []))
                               for exp in EXPERIMENTS}
    return settings


# ----------------------------------------------------------------------------- cases

def known_models(root: Path | str = ".") -> set[str]:
    """Model names of the zoo, from the JSON files under ``configs/models`` (light)."""
    base = Path(root) / "configs" / "models"
    return {p.relative_to(base).with_suffix("").as_posix() for p in base.rglob("*.json")}


def model_family(model: str, root: Path | str = ".") -> str | None:
    """``_slapo.family`` of the model's JSON config; None if it cannot be read."""
    try:
        data = json.loads((Path(root) / "configs" / "models" / f"{model}.json").read_text())
        return data["_slapo"]["family"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def model_label(model: str, root: Path | str = ".") -> str:
    """The paper's label of a model (``BERT-1B``) where its config names one, else the name."""
    try:
        data = json.loads((Path(root) / "configs" / "models" / f"{model}.json").read_text())
        return data["_slapo"].get("paper_label") or model
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return model


def load_cases(settings: dict, root: Path | str = ".") -> dict[str, dict[str, Case]]:
    """``{experiment: {case_id: Case}}`` of the profile's cfg files, in file order.

    Raises :class:`PlanError` listing every bad line (``file:line: ...``) and any case id that
    two cfg files of one experiment both define.
    """
    root = Path(root)
    models = known_models(root)
    errors, cases = [], {}
    for exp, cfgs in settings["experiments"].items():
        cases[exp] = {}
        for cfg in cfgs:
            path = root / cfg
            if not path.is_file():
                errors.append(f"{cfg}: no such cfg file (profile {settings['name']}, {exp})")
                continue
            try:
                parsed = parse_cfg(path, max_gpus=settings["max_gpus"], known_models=models)
            except CfgError as err:
                errors.extend(e.replace(str(path), cfg, 1) for e in err.errors)
                continue
            for case in parsed:
                if case.id in cases[exp]:
                    first = cases[exp][case.id]
                    errors.append(f"{cfg}:{case.line}: duplicate case {case.id} "
                                  f"(also at {first.where})")
                else:
                    cases[exp][case.id] = case
    if errors:
        raise PlanError("\n".join(errors))
    return cases


def case_spec(case: Case, settings: dict) -> dict:
    """What a case's job is given (its Snakemake ``params``): the case's own fields and the
    profile's run settings that shape the result (steps, warm-up, dtype, device). No cfg file
    name or line number, so moving a line reruns nothing; no timeout (a job resource), so
    raising it does not rerun finished cases."""
    return {
        "case_id": case.id,
        "mode": case.mode,
        "model": case.model,
        "gpus": case.gpus,
        "seq_len": case.seq_len,
        "dec_seq_len": case.dec_seq_len,
        "batch_size": case.batch_size,
        "ckpt": case.ckpt_token,
        "steps": int(settings["steps"]),
        "warmup": int(settings["warmup"]),
        "dtype": settings["dtype"],
        "device": settings["device"],
    }


def case_spec_json(case: Case, settings: dict) -> str:
    return json.dumps(case_spec(case, settings), sort_keys=True, separators=(",", ":"))


def gpus_resource(case: Case, settings: dict) -> int:
    """The ``gpus`` resource of a case's job: its GPU count on CUDA, 0 on CPU ranks."""
    return case.gpus if settings["device"] == "cuda" else 0


def threads(case: Case, settings: dict, cores: int | None) -> int:
    """Cores a case's job holds (its ``threads``), out of the ``cores`` the workflow may use
    (``workflow.cores``; None: this machine's).

    On CPU all of them, so that cases run one at a time and none measures beside another's
    start-up or steps (docs/workflow.md, "Measurements the claims stand on"). On CUDA the
    share of the cores that the case's GPUs are of the machine's, at least one.
    """
    cores = cores if isinstance(cores, int) and cores > 0 else (os.cpu_count() or 1)
    if settings["device"] == "cpu":
        return cores
    gpus_available = max(int(settings.get("gpus_available") or 0), case.gpus, 1)
    return max(1, cores * case.gpus // gpus_available)


def rank_cores(case: Case, settings: dict, cores: int | None) -> int:
    """Cores a case's ranks share (the harness's ``--cores``; each rank runs
    ``max(1, rank_cores // ranks)`` threads, :mod:`slapo.bench.threads`): on CPU one per rank,
    a rank standing for a GPU; on CUDA all the job holds (:func:`threads`)."""
    if settings["device"] == "cpu":
        return case.gpus
    return threads(case, settings, cores)


# ----------------------------------------------------------------------------- dependencies

def _py_files(root: Path, rel: str, recursive: bool = True) -> list[str]:
    base = root / rel
    if not base.is_dir():
        return []
    found = base.rglob("*.py") if recursive else base.glob("*.py")
    return sorted(p.relative_to(root).as_posix() for p in found if "__pycache__" not in p.parts)


def harness_files(root: Path | str = ".") -> list[str]:
    """Code every case runs: ``slapo/**.py`` except the schedules of ``slapo/model_schedule``
    and the analysis modules, plus the case runner of the workflow."""
    root = Path(root)
    files = []
    for rel in _py_files(root, "slapo"):
        parts = Path(rel).parts
        if rel.startswith(SCHEDULE_DIR + "/"):
            continue
        if parts[:2] == ("slapo", "bench"):
            sub = Path(*parts[2:]).as_posix()
            if sub in ANALYSIS_MODULES:
                continue
            if parts[2] in ANALYSIS_DIRS and sub not in CASE_RUNNER:
                continue
        files.append(rel)
    return files


def schedule_file(family: str | None, root: Path | str = ".") -> str | None:
    """The schedule file of a family (``slapo/model_schedule/bert.py``) if it exists."""
    for name in FAMILY_FILES.get(family, ()):
        rel = f"{SCHEDULE_DIR}/{name}"
        if (Path(root) / rel).is_file():
            return rel
    return None


def schedule_files(root: Path | str = ".") -> dict[str, str]:
    """``{family: path}`` of every family schedule present (Table 4's inputs)."""
    found = {family: schedule_file(family, root) for family in FAMILY_FILES}
    return {family: path for family, path in found.items() if path}


def shared_schedule_files(root: Path | str = ".") -> list[str]:
    """Modules of ``slapo/model_schedule`` every Slapo mode runs: all but the family
    schedules and the line counter."""
    family = {name for names in FAMILY_FILES.values() for name in names}
    return [rel for rel in _py_files(Path(root), SCHEDULE_DIR, recursive=False)
            if Path(rel).name not in family and Path(rel).name not in SCHEDULE_NOT_RUN]


@functools.lru_cache(maxsize=None)
def _sibling_imports(path: str) -> tuple[str, ...]:
    """Modules of the same package that ``path`` imports (``from .x import``,
    ``from . import x``), transitively; paths as given, relative to the same root."""
    base = Path(path).parent
    found, todo = [], [Path(path)]
    while todo:
        current = todo.pop()
        try:
            tree = ast.parse(current.read_text())
        except (OSError, SyntaxError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or node.level != 1:
                continue
            names = [node.module] if node.module else [a.name for a in node.names]
            for name in names:
                candidate = base / f"{name.split('.')[0]}.py"
                if candidate.is_file() and candidate != Path(path) and \
                        str(candidate) not in found:
                    found.append(str(candidate))
                    todo.append(candidate)
    return tuple(found)


def uses_schedule(mode: str) -> bool:
    """Whether a mode applies a Slapo schedule (``slapo-*``; the ablation's steps too)."""
    return mode.startswith("slapo")


def case_inputs(case: Case, root: Path | str = ".", harness: list[str] | None = None,
                shared: list[str] | None = None) -> list[str]:
    """Files whose change reruns ``case`` (see the module docstring); ``harness`` and
    ``shared`` (:func:`harness_files`, :func:`shared_schedule_files`) may be passed in, to
    list the folders once for all cases."""
    root = Path(root)
    files = list(harness if harness is not None else harness_files(root))
    config = Path("configs") / "models" / f"{case.model}.json"
    if (root / config).is_file():
        files.append(config.as_posix())
    if uses_schedule(case.mode):
        files += shared if shared is not None else shared_schedule_files(root)
        family_file = schedule_file(model_family(case.model, root), root)
        if family_file:
            files.append(family_file)
            for sibling in _sibling_imports(str(root / family_file)):
                rel = Path(sibling).relative_to(root).as_posix()
                if rel not in files and Path(rel).name not in SCHEDULE_NOT_RUN:
                    files.append(rel)
    return files


def python_on_path() -> None:
    """Put this interpreter's directory first on ``PATH``, so that the jobs' ``python`` is
    the one running Snakemake (the project's virtual environment) even when it is not
    activated."""
    bindir = str(Path(sys.executable).parent)
    path = os.environ.get("PATH", "")
    if path.split(os.pathsep)[:1] != [bindir]:
        os.environ["PATH"] = os.pathsep.join([bindir, path]) if path else bindir


SLOTS_DIR_ENV = "SLAPO_GPU_SLOTS_DIR"
SLOTS_TOTAL_ENV = "SLAPO_GPU_SLOTS_TOTAL"


def export_slots(config: dict, settings: dict) -> None:
    """Tell the case runners where the GPU slots are (environment variables the jobs inherit;
    not params, so a new lock folder reruns nothing). Cleared on CPU profiles and with
    ``gpu_slots: false``."""
    if settings["device"] == "cuda" and config.get("gpu_slots", True):
        os.environ[SLOTS_DIR_ENV] = slots_dir(config)
        os.environ[SLOTS_TOTAL_ENV] = str(settings["gpus_available"])
    else:
        os.environ.pop(SLOTS_DIR_ENV, None)
        os.environ.pop(SLOTS_TOTAL_ENV, None)


def runtime_minutes(settings: dict) -> int:
    """The ``runtime`` resource of a case (minutes, for cluster schedulers): its timeout plus
    the runner's grace period."""
    from slapo.bench.workflow.run_case import GRACE_S

    return -(-(int(settings["timeout"]) + GRACE_S) // 60)


def slots_dir(config: dict) -> str:
    """Where the GPU slot locks live: ``config["gpu_slots_dir"]`` or a per-user temp folder
    (machine-wide, so two workflows on one machine share the GPUs fairly)."""
    configured = config.get("gpu_slots_dir") or ""
    if configured:
        return configured
    tmp = os.environ.get("TMPDIR", "/tmp")
    user = os.environ.get("USER") or str(os.getuid())
    return str(Path(tmp) / f"slapo-gpu-slots-{user}")


def main(argv=None) -> int:
    """``python workflow/scripts/run_module.py slapo.bench.workflow.plan [--gpus]``: the
    active profile and its cases (``--gpus``: only the GPU count, e.g. for
    ``--resources gpus=N``)."""
    import argparse

    import yaml

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--config", default="configs/config.yaml")
    parser.add_argument("--profile", default=None, help="override the config's profile")
    parser.add_argument("--gpus", action="store_true", help="print the GPUs detected, only")
    args = parser.parse_args(argv)
    if args.gpus:
        print(detect_gpus())
        return 0
    config = yaml.safe_load(Path(args.config).read_text())
    if args.profile:
        config["profile"] = args.profile
    settings = resolve(config)
    cases = load_cases(settings)
    print(f"profile {settings['name']} ({settings['gpus_available']} GPUs visible, device "
          f"{settings['device']}, {settings['dtype']}, {settings['steps']} steps of which "
          f"{settings['warmup']} warm-up)")
    for exp, found in cases.items():
        print(f"  {exp}: {len(found)} cases from {', '.join(settings['experiments'][exp])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
