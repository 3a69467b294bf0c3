"""Which source files each result depends on: the workflow's rerun inputs, decided here by the
package that owns the files (the planner only asks).

- A case runs the schedule language (``slapo/``, but the model schedules), the artifact's
  case model, zoo and harness (every module of ``slapo_ae`` but the analysis and this one),
  and its model's JSON config. A Slapo mode also runs ``slapo/model_schedule``: its shared
  modules and its own family's schedule, which ``slapo.model_schedule`` names after the
  model type (``bert.py``), so that editing ``bert.py`` reruns the BERT cases of Slapo modes
  and nothing else. A case on several nodes also runs ``scripts/srun_case.sh`` (under Slurm,
  the one way its agents start there).
- A tuning's round (which trials next) runs the search of ``slapo/autotune``, which no case
  runs, and the spec reader (:func:`tuning_sources`); its trials are cases.
- An analysis step (CSV, figure, Table 4, claims) runs its module of ``slapo_ae/analysis`` and
  the modules that one imports (:data:`ANALYSIS_STEPS`, checked against the imports by
  ``tests/unit/test_layout.py``); ``gaps`` and ``recheck`` also run cases again, so the case
  code too. Editing ``plots.py`` redraws the figures and reruns nothing else.

Paths are relative to the checkout's root, sorted, and light to compute (no imports of
torch, no parsing of the code): the planner calls this for every case while Snakemake builds
the DAG.
"""
from __future__ import annotations

from pathlib import Path

from slapo_ae import paths
from slapo_ae.zoo.configs import FAMILIES, config_dir, model_family

SCHEDULES = "slapo/model_schedule"
# what every family's schedule imports: the package and its shared building blocks (the
# package imports apply_schedule's module); every other module there is one family's schedule
SHARED_SCHEDULE_MODULES = ("__init__.py", "common.py", "api.py")
# planning, analysis and the tunings' rounds, not a case
NOT_RUN = ("slapo_ae/sources.py", "slapo_ae/analysis", "slapo_ae/tuning.py",
           "slapo_ae/harness/tune.py")
SRUN_CASE = "scripts/srun_case.sh"  # how the agents of a case on several nodes start under srun
AUTOTUNE = "slapo/autotune"  # the search: run by a tuning's rounds, never by a case
# What reading the zoo's model configs imports (slapo_ae/zoo/configs.py and its rules)
ZOO_CONFIGS = ("paths", "textfile", "zoo/configs", "zoo/fields")
# The modules of slapo_ae each analysis step imports (module-level), its own first.
ANALYSIS_STEPS = {
    "aggregate": ("analysis/aggregate", "atomic", *ZOO_CONFIGS),
    "plots": ("analysis/plots", "analysis/aggregate", "atomic", *ZOO_CONFIGS),
    "table4": ("analysis/table4", "analysis/loc", "sources", *ZOO_CONFIGS),
    "claims": ("analysis/claims", "analysis/aggregate", "atomic", *ZOO_CONFIGS),
    "gaps": ("analysis/gaps", "analysis/claims", "analysis/aggregate", "analysis/rerun",
             "atomic", *ZOO_CONFIGS),
    "recheck": ("analysis/recheck", "analysis/gaps", "analysis/claims", "analysis/aggregate",
                "analysis/rerun", "atomic", *ZOO_CONFIGS),
    "autotune": ("analysis/autotune", "atomic", "case", "cfg", "expr", "record", "tuning",
                 *ZOO_CONFIGS),
}
RERUNS_CASES = ("gaps", "recheck")  # analysis steps that run cases: the case code is input
# What a tuning's round job runs (slapo_ae/harness/tune.py): the spec reader, the records and
# the search of slapo/autotune (with slapo's logger). Editing them reruns the rounds, which
# are cheap; the trials are cases, cached by their own sources.
TUNING_MODULES = ("harness/tune", "tuning", "atomic", "case", "cfg", "expr", "record",
                  *ZOO_CONFIGS)


def _py_files(root: Path, folder: str) -> list[str]:
    base = root / folder
    return sorted(p.relative_to(root).as_posix() for p in base.rglob("*.py")
                  if "__pycache__" not in p.parts)


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + "/")


def case_code(root: Path | str = paths.ROOT) -> list[str]:
    """Code every case runs, whatever its mode (see the module docstring)."""
    root = Path(root)
    library = [f for f in _py_files(root, "slapo")
               if not _under(f, SCHEDULES) and not _under(f, AUTOTUNE)]
    artifact = [f for f in _py_files(root, "slapo_ae")
                if not any(_under(f, skip) for skip in NOT_RUN)]
    return library + artifact


def schedule_files(root: Path | str = paths.ROOT) -> dict[str, str]:
    """``{family: path}`` of every family schedule present (Table 4 counts them)."""
    root = Path(root)
    found = {family: f"{SCHEDULES}/{family}.py" for family in FAMILIES}
    return {family: path for family, path in found.items() if (root / path).is_file()}


def uses_schedule(mode: str) -> bool:
    """Whether a mode applies a Slapo schedule (``slapo-*``; the ablation's steps too)."""
    return mode.startswith("slapo")


def case_sources(case, root: Path | str = paths.ROOT, code: list[str] | None = None) -> list[str]:
    """Files whose change reruns ``case``; ``code`` (:func:`case_code`) may be passed in, to
    list the folders once for all cases."""
    root = Path(root)
    files = list(code if code is not None else case_code(root))
    config = config_dir() / f"{case.model}.json"
    if config.is_file():
        try:
            files.append(config.resolve().relative_to(root.resolve()).as_posix())
        except ValueError:  # configs outside the checkout ($SLAPO_MODEL_CONFIGS)
            files.append(str(config))
    if uses_schedule(case.mode):
        try:
            family = model_family(case.model)
        except (KeyError, ValueError):
            family = None
        mine = {f"{SCHEDULES}/{name}" for name in (*SHARED_SCHEDULE_MODULES, f"{family}.py")}
        files += [f for f in _py_files(root, SCHEDULES) if f in mine]
    if case.nodes > 1:
        files.append(SRUN_CASE)
    return files


def tuning_sources(root: Path | str = paths.ROOT) -> list[str]:
    """Files whose change reruns a tuning's rounds (:data:`TUNING_MODULES`, the search)."""
    return ([f"slapo_ae/{name}.py" for name in TUNING_MODULES]
            + _py_files(Path(root), AUTOTUNE) + ["slapo/logger.py"])


def analysis_sources(step: str, root: Path | str = paths.ROOT) -> list[str]:
    """Files whose change reruns the analysis ``step`` (a key of :data:`ANALYSIS_STEPS`);
    for the steps that run cases again (:data:`RERUNS_CASES`) the case code as well."""
    files = [f"slapo_ae/{name}.py" for name in ANALYSIS_STEPS[step]]
    if step in RERUNS_CASES:
        files += [f for f in case_code(root) if f not in files]
    return files
