"""What the workflow runs: the active profile, its cases, and what each job is given.

Imported by ``workflow/rules/common.smk`` while Snakemake builds the DAG, so it stays light:
no torch, no pandas, no model building.

Profiles (``configs/config.yaml``, key ``profiles``) name the cfg files of each experiment and
the run settings (device, dtype, steps, warm-up, timeout). ``profile: auto`` picks one from the
GPUs visible (:func:`slapo_ae.gpus.visible_gpus`): none -> ``cpu``, 1 to 7 -> ``gpu1``, 8 or
more -> ``paper`` (:func:`auto_profile`).

Rerun semantics (what Snakemake sees of a case):

- the case with the profile's run settings is the job's ``params`` (:func:`job_case`,
  :meth:`slapo_ae.case.Case.to_json`), not the cfg file, so editing one cfg line reruns only
  the cases of that line (and the aggregates that read them);
- the code a case runs is its ``input``, as the artifact package says
  (:func:`slapo_ae.sources.case_sources`): editing a family's schedule reruns the cases of
  Slapo modes on that family and nothing else.

Run order: the cases that the claims compare run one after another (:func:`run_order`, the
case rule's ``priority``), so that the machine's drift falls between comparisons more than
within them.

Cases on several nodes: a profile with ``gpus_per_node`` (the GPUs of one machine of the
cluster it is written for) spreads a case of more GPUs over ``gpus // gpus_per_node`` nodes
(:func:`spread_over_nodes`; the case id gains ``__n<nodes>``). How their agents start is the
config's ``nodes_via`` (``local``: all on this machine; ``srun``: one per node of the case's
Slurm job), which the case runner reads from the environment (:func:`export_nodes_via`); the
Slurm resources that ask for the nodes are :func:`node_resources`.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

from slapo_ae import gpus, textfile
from slapo_ae.case import Case
from slapo_ae.cfg import CfgError, parse_cfg
from slapo_ae.harness.runner import (  # a light module
    GRACE_S,
    NODES_VIA_ENV,
    SLOTS_DIR_ENV,
    SLOTS_TOTAL_ENV,
)
from slapo_ae.tuning import TuningError, TuningSpec, load_tuning
from slapo_ae.zoo.configs import list_models

CFG_EXPERIMENTS = ("e2e", "ablation", "multinode")  # cfg files of cases
EXPERIMENTS = (*CFG_EXPERIMENTS, "autotune")  # autotune lists tuning specs
PROFILE_BY_GPUS = ((8, "paper"), (1, "gpu1"), (0, "cpu"))  # (at least this many GPUs, profile)


class PlanError(ValueError):
    """A config or cfg problem found while planning the DAG (message names the file)."""


# ----------------------------------------------------------------------------- GPUs, profile

def auto_profile(gpus: int) -> str:
    """The profile ``profile: auto`` picks for ``gpus`` visible GPUs."""
    for minimum, name in PROFILE_BY_GPUS:
        if gpus >= minimum:
            return name
    return "cpu"


def resolve(config: dict, env: dict | None = None) -> dict:
    """The settings of the active profile, completed: ``{"name", "gpus_available", "device",
    "dtype", "steps", "warmup", "timeout", "max_gpus", "gpus_per_node", "recheck_budget_s",
    "time_target_s", "time_reserved_s", "experiments": {exp: [cfg, ...]}}`` (``gpus_per_node``
    None: every case on one node; ``recheck_budget_s`` and ``time_target_s`` None: the recheck
    has no time limit of that kind).

    ``config["gpus"]``: ``"auto"`` (detect) or a number; ``config["profile"]``: ``"auto"`` or
    a key of ``config["profiles"]``.
    """
    count = config.get("gpus", "auto")
    count = gpus.visible_gpus(env) if count in ("auto", None) else int(count)
    name = config.get("profile", "auto")
    name = auto_profile(count) if name in ("auto", None) else str(name)
    profiles = config.get("profiles", {})
    if name not in profiles:
        raise PlanError(f"profile {name!r} is not defined in the config; "
                        f"defined: {', '.join(sorted(profiles))}")
    settings = dict(profiles[name])
    settings["name"] = name
    if settings["warmup"] >= settings["steps"]:
        raise PlanError(f"profile {name}: warmup ({settings['warmup']}) must be below steps "
                        f"({settings['steps']}): no timed step would remain")
    if settings.get("device") == "cpu" and settings.get("dtype", "fp32") != "fp32":
        raise PlanError(f"profile {name}: dtype {settings['dtype']} on device cpu: CPU cases "
                        "train in fp32 only (every case would be recorded unsupported)")
    settings["gpus_available"] = count
    settings.setdefault("max_gpus", max(count, 1))
    settings.setdefault("gpus_per_node", None)
    settings.setdefault("recheck_budget_s", None)
    settings.setdefault("reruns", True)
    settings.setdefault("time_target_s", None)
    settings.setdefault("time_reserved_s", None)
    settings["experiments"] = {exp: list(settings.get("experiments", {}).get(exp, []))
                               for exp in EXPERIMENTS}
    return settings


# ----------------------------------------------------------------------------- cases

def load_cases(settings: dict, root: Path | str = ".") -> dict[str, dict[str, Case]]:
    """``{experiment: {case_id: Case}}`` of the profile's cfg files, in file order, each case
    spread over the nodes its GPUs need (:func:`spread_over_nodes`).

    Raises :class:`PlanError` listing every bad line (``file:line: ...``) and any case id that
    two cfg files of one experiment both define.
    """
    root = Path(root)
    models = set(list_models())
    errors, cases = [], {}
    for exp in CFG_EXPERIMENTS:
        cfgs = settings["experiments"].get(exp, [])
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
                try:
                    case = spread_over_nodes(case, settings)
                except PlanError as err:
                    errors.append(f"{cfg}:{case.line}: {err}")
                    continue
                if case.id in cases[exp]:
                    first = cases[exp][case.id]
                    errors.append(f"{cfg}:{case.line}: duplicate case {case.id} "
                                  f"(also at {first.where})")
                else:
                    cases[exp][case.id] = case
    if errors:
        raise PlanError("\n".join(errors))
    return cases


def spread_over_nodes(case: Case, settings: dict) -> Case:
    """``case`` on the nodes its GPUs fill: ``gpus // gpus_per_node`` of the profile's
    ``gpus_per_node``, one where the case fits one node or the profile names no node size.
    :class:`PlanError` when the GPUs do not fill whole nodes."""
    per_node = settings.get("gpus_per_node")
    if not per_node or case.gpus <= per_node:
        return case
    if case.gpus % per_node:
        raise PlanError(f"{case.gpus} GPUs do not fill whole nodes of {per_node} (gpus_per_node "
                        f"of profile {settings['name']})")
    return dataclasses.replace(case, nodes=case.gpus // per_node)


def load_tunings(settings: dict, root: Path | str = ".") -> dict[str, TuningSpec]:
    """``{name: TuningSpec}`` of the profile's tuning specs (``experiments.autotune``).

    Raises :class:`PlanError` listing every bad spec (``file:line: ...``) and any tuning name
    (a spec's file stem) that two specs share.
    """
    root = Path(root)
    models = set(list_models())
    errors, tunings = [], {}
    for rel in settings["experiments"].get("autotune", []):
        path = root / rel
        if not path.is_file():
            errors.append(f"{rel}: no such tuning spec (profile {settings['name']}, autotune)")
            continue
        try:
            spec = load_tuning(path, known_models=models)
        except TuningError as err:
            errors.append(str(err).replace(str(path), rel, 1))
            continue
        if spec.name in tunings:
            errors.append(f"{rel}: a second tuning named {spec.name!r} (also "
                          f"{tunings[spec.name].path})")
            continue
        tunings[spec.name] = dataclasses.replace(spec, path=rel)
    if errors:
        raise PlanError("\n".join(errors))
    return tunings


def run_order(cases: dict[str, dict[str, Case]]) -> dict[tuple[str, str], int]:
    """``{(experiment, case_id): priority}``, higher first: the order in which Snakemake picks
    the cases (each holds the machine on CPU, so one runs at a time).

    A case that runs minutes after the case it is compared with measures the machine's drift
    as well (docs/workflow.md, Back to back). So the systems of one Figure 7 or Figure 8 point
    (model, GPUs, nodes, sequence lengths) run one after another, in cfg order at one point
    and the reverse at the next, so that no system always runs first; the ablation's steps,
    each compared with the one before, run in cfg order. A tuning's trials keep priority 0:
    its rounds decide which run."""
    order: list[tuple[str, str]] = []
    for exp in CFG_EXPERIMENTS:
        if exp == "ablation":
            order += [(exp, case_id) for case_id in cases.get(exp, {})]
            continue
        points: dict[tuple, list[str]] = {}
        for case_id, case in cases.get(exp, {}).items():
            point = (case.model, case.gpus, case.nodes, case.seq_len, case.dec_seq_len)
            points.setdefault(point, []).append(case_id)
        for i, ids in enumerate(points.values()):
            order += [(exp, case_id) for case_id in (ids if i % 2 == 0 else ids[::-1])]
    return {key: len(order) - i for i, key in enumerate(order)}


def tuning_experiment(name: str) -> str:
    """The experiment (records folder under results/) of a tuning's trials."""
    return f"autotune/{name}"


def tuning_cases(tunings: dict[str, TuningSpec]) -> dict[str, dict[str, Case]]:
    """``{experiment: {case_id: Case}}``: every point of each tuning as a case (which of them
    run is decided by the tuning's rounds)."""
    return {tuning_experiment(name): {cid: case for cid, (_, case) in spec.cases().items()}
            for name, spec in tunings.items()}


def tuned_e2e(cases: dict[str, Case], chosen: list[Case]) -> dict[str, Case]:
    """The e2e cases with each tuning's chosen case in place of the case of the same system,
    model, GPUs and sequence lengths (where it was in the order; added at the end where the
    profile has none), without the tuning's memory cap: the Figure 7 case of that model with
    the tuned batch and ratio."""
    def cell(case: Case) -> tuple:
        return case.mode, case.model, case.gpus, case.nodes, case.seq_len, case.dec_seq_len

    tuned = {cell(c): dataclasses.replace(c, memory_per_rank=None) for c in chosen}
    out = {}
    for case in cases.values():  # in place: a tuned case keeps its cell's turn (run_order)
        case = tuned.pop(cell(case), case)
        out[case.id] = case
    out.update({case.id: case for case in tuned.values()})
    return out


def _unique_key_loader():
    """A safe YAML loader that refuses a key given twice in one mapping (PyYAML keeps the
    last one without a word: a profile written twice would run only its second form)."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    def mapping(loader, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = loader.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r} is given twice in one mapping",
                    key_node.start_mark)
            seen.add(key)
        return loader.construct_mapping(node, deep)

    Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    return Loader


def check_yaml(path: str | Path) -> None:
    """Raise :class:`PlanError` naming ``path:line:column`` when ``path`` is no valid YAML
    (a missing file is left to Snakemake, which says so)."""
    import yaml

    path = Path(path)
    try:
        yaml.load(textfile.read_text(path), Loader=_unique_key_loader())  # noqa: S506
    except FileNotFoundError:
        return
    except textfile.NotTextError as err:
        raise PlanError(str(err)) from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = getattr(err, "problem", None) or str(err)
        raise PlanError(f"{where}: not valid YAML: {problem}") from None


def check_config(config: dict, schema_path: str | Path) -> None:
    """Raise :class:`PlanError` naming the key of the first value (config file or
    ``--config``) that the workflow's JSON schema refuses, in one line."""
    import jsonschema
    import yaml

    schema = yaml.safe_load(Path(schema_path).read_text())
    validator = jsonschema.validators.validator_for(schema)(schema)
    errors = sorted(validator.iter_errors(config), key=lambda e: [str(p) for p in e.path])
    if errors:
        error = errors[0]
        key = ".".join(str(p) for p in error.path) or "the config"
        hint = ""
        if error.validator == "type" and isinstance(error.instance, str) and len(error.path) > 1:
            hint = (" (Snakemake reads a value inside a --config mapping as a string: set it in "
                    "configs/config.yaml or a --configfile)")
        raise PlanError(f"configs/config.yaml (or --config): {key}: {error.message}{hint}")


def job_case(case: Case, settings: dict, tuning: TuningSpec | None = None) -> Case:
    """What a case's job is given (its Snakemake ``params``): the case with the profile's run
    settings that shape the result (steps, warm-up, dtype, device; a tuning's trials take its
    own steps and warm-up where it sets them). No cfg file name or line number, so moving a
    line reruns nothing; no timeout (a job resource), so raising it does not rerun finished
    cases."""
    steps, warmup = settings["steps"], settings["warmup"]
    if tuning is not None and tuning.steps is not None:
        steps, warmup = tuning.steps, tuning.warmup
    return case.for_run(steps, warmup, settings["dtype"], settings["device"])


def gpus_resource(case: Case, settings: dict) -> int:
    """The ``gpus`` resource of a case's job: its GPU count on CUDA, 0 on CPU ranks, at most
    the GPUs this machine has (where it has any): a case that needs more then runs its job,
    whose runner records it ``unsupported``, where Snakemake would stop the whole run ("Job
    needs gpus=8 but only gpus=4")."""
    if settings["device"] != "cuda":
        return 0
    return _at_most_the_machines(case.gpus, settings)


def machine_job_gpus(settings: dict) -> tuple[int, int]:
    """``(gpus, gpu)`` of a job that reruns cases (the recheck, the gaps profiles), holding
    the GPUs as the largest case does: ``gpus`` for packing jobs on this machine (at most its
    GPUs, as :func:`gpus_resource`), ``gpu`` for the Slurm plugin's request (all of them)."""
    if settings["device"] != "cuda":
        return 0, 0
    return _at_most_the_machines(settings["max_gpus"], settings), settings["max_gpus"]


def _at_most_the_machines(count: int, settings: dict) -> int:
    available = int(settings.get("gpus_available") or 0)
    return min(count, available) if available else count


def machine_cores(cores: int | None) -> int:
    """``cores`` (``workflow.cores``), or this machine's where the command gives none."""
    return cores if isinstance(cores, int) and cores > 0 else (os.cpu_count() or 1)


def threads(case: Case, settings: dict, cores: int | None) -> int:
    """Cores a case's job holds (its ``threads``), out of the ``cores`` the workflow may use
    (``workflow.cores``; None: this machine's).

    On CPU all of them, so that cases run one at a time and none measures beside another's
    start-up or steps (docs/measurements.md, "What the measurements stand on"). On CUDA the
    share of the cores that the case's GPUs on one node are of the machine's, at least one
    (on each node of a case on several).
    """
    cores = machine_cores(cores)
    if settings["device"] == "cpu":
        return cores
    gpus_available = max(int(settings.get("gpus_available") or 0), case.gpus_per_node, 1)
    return max(1, cores * case.gpus_per_node // gpus_available)


def rank_cores(case: Case, settings: dict, cores: int | None) -> int:
    """Cores the ranks of a case on one node share (the harness's ``--cores``; each rank runs
    ``max(1, rank_cores // ranks)`` threads, :mod:`slapo_ae.harness.threads`): on CPU one per rank,
    a rank standing for a GPU; on CUDA all the job holds (:func:`threads`)."""
    if settings["device"] == "cpu":
        return case.gpus_per_node
    return threads(case, settings, cores)


NODE_RESOURCES = ("nodes", "tasks", "mpi", "tasks_per_gpu", "cpus_per_task", "gres")


def node_resources(case: Case, settings: dict, config: dict, cores: int | None) -> dict:
    """The resources that ask the executor for the nodes of a case on several nodes, keyed by
    :data:`NODE_RESOURCES`; None where not needed (Snakemake drops them), so one-node jobs are
    as before. ``nodes``: the case's nodes, or at most the config's ``max_job_nodes`` (the
    cluster's machines; the agents then share them). With ``nodes_via: srun`` the job is one
    Slurm task per agent: ``tasks``, and ``mpi`` so that the executor plugin runs the job's
    command as it is (it calls srun itself, ``scripts/srun_case.sh``) instead of inside
    ``srun -n1``; ``cpus_per_task`` the cores of one agent; on CUDA ``gres`` asks for each
    machine's GPUs and ``tasks_per_gpu`` 0 keeps the plugin from deriving a task count per GPU
    from ``tasks``."""
    found = dict.fromkeys(NODE_RESOURCES)
    if case.nodes == 1:
        return found
    limit = int(config.get("max_job_nodes") or 0)
    machines = min(case.nodes, limit) if limit > 0 else case.nodes
    found["nodes"] = machines
    if config.get("nodes_via", "local") != "srun":
        return found
    agents_per_machine = -(-case.nodes // machines)
    found.update(tasks=case.nodes, mpi="srun",
                 cpus_per_task=max(1, threads(case, settings, cores) // agents_per_machine))
    if settings["device"] == "cuda":
        found.update(gres=f"gpu:{case.gpus // machines}", tasks_per_gpu=0)
    return found


def gpu_request(case: Case, settings: dict) -> int | None:
    """The ``gpu`` resource (the Slurm plugin's ``--gpus``, all of the job's GPUs): the
    ``gpus`` resource for a case on one node; None on several, whose GPUs are asked per
    machine (``gres``, :func:`node_resources`)."""
    if case.nodes > 1:
        return None
    return case.gpus if settings["device"] == "cuda" else 0


def python_on_path() -> None:
    """Put this interpreter's directory first on ``PATH``, so that the jobs' ``python`` is
    the one running Snakemake (the project's virtual environment) even when it is not
    activated."""
    bindir = str(Path(sys.executable).parent)
    path = os.environ.get("PATH", "")
    if path.split(os.pathsep)[:1] != [bindir]:
        os.environ["PATH"] = os.pathsep.join([bindir, path]) if path else bindir


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


def export_nodes_via(config: dict) -> None:
    """Tell the case runners where the agents of a case on several nodes run (the config's
    ``nodes_via``; an environment variable, not a param: running the same cases under
    Slurm reruns nothing)."""
    os.environ[NODES_VIA_ENV] = str(config.get("nodes_via") or "local")


def runtime_minutes(settings: dict) -> int:
    """The ``runtime`` resource of a case (minutes, for cluster schedulers): its timeout plus
    the runner's grace period."""
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
    """``python workflow/plan.py``: the active profile and its cases (the GPU count alone, e.g.
    for ``--resources gpus=N``, is ``python -m slapo_ae.gpus``)."""
    import argparse

    import yaml

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--config", default="configs/config.yaml")
    parser.add_argument("--profile", default=None, help="override the config's profile")
    args = parser.parse_args(argv)
    config = yaml.safe_load(textfile.read_text(args.config))
    if args.profile:
        config["profile"] = args.profile
    settings = resolve(config)
    cases = load_cases(settings)
    tunings = load_tunings(settings)
    print(f"profile {settings['name']} ({settings['gpus_available']} GPUs visible, device "
          f"{settings['device']}, {settings['dtype']}, {settings['steps']} steps of which "
          f"{settings['warmup']} warm-up)")
    for exp, found in cases.items():
        print(f"  {exp}: {len(found)} cases from {', '.join(settings['experiments'][exp])}")
    for name, spec in tunings.items():
        print(f"  autotune {name}: a grid of {len(spec.points())} points "
              f"({', '.join(spec.strategies)}) from {spec.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
