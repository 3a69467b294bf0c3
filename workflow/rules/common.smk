# Config, profile and cases: the helpers every rule file uses (no rules here).
import json
import shlex
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError
from snakemake.utils import min_version, validate

min_version("9.0")

# This checkout's artifact package and planner, whatever else is installed (none loads torch)
sys.path[:0] = [str(Path(workflow.basedir)), str(Path(workflow.basedir) / "workflow")]

import plan
from slapo_ae import sources
from slapo_ae.cfg import parse_cfg_text



def refuse(err):
    """Bad input stops the workflow before any job: a line per problem, exit status 2."""
    print(f"error: {err}", file=sys.stderr)
    sys.exit(2)


# Snakemake names only the Snakefile when the YAML is broken: say the file, line and column
try:
    plan.check_yaml("configs/config.yaml")
except plan.PlanError as err:
    refuse(err)


configfile: "configs/config.yaml"


def validate_config():
    """Snakemake's schema check, which also fills in the defaults; when it refuses, the first
    refused key in one line rather than Snakemake's dump of the whole schema."""
    try:
        validate(config, schema="../schemas/config.schema.yaml", set_default=True)
    except WorkflowError:
        plan.check_config(config, Path(workflow.basedir) / "workflow/schemas/config.schema.yaml")
        raise


try:
    validate_config()
    PROFILE = plan.resolve(config)
    CASES = plan.load_cases(PROFILE)  # {experiment: {case_id: Case}}
    TUNINGS = plan.load_tunings(PROFILE)  # {name: TuningSpec}
    CASES.update(plan.tuning_cases(TUNINGS))  # every point of a tuning, as a case
    TUNED = config["tuned"] in (True, "true")  # --config tuned=true: the tuned Figure 7 cases
    RUN_ORDER = plan.run_order(CASES)  # compared cases one after another
except plan.PlanError as err:
    refuse(err)

plan.python_on_path()  # jobs' `python` is the interpreter running Snakemake
CASE_CODE = sources.case_code()
ENV = "../envs/slapo.yaml"
plan.export_slots(config, PROFILE)  # GPU slot folder and count, for the jobs' environment
plan.export_nodes_via(config)  # where the agents of a case on several nodes run


def case_of(wildcards):
    try:
        if wildcards.experiment == "e2e" and TUNED:
            return e2e_cases()[wildcards.case_id]  # the tuned cases among them (below)
        return CASES[wildcards.experiment][wildcards.case_id]
    except KeyError:
        raise ValueError(
            f"no case {wildcards.case_id!r} in experiment {wildcards.experiment!r} of "
            f"profile {PROFILE['name']!r}"
        ) from None


def case_priority(wildcards):
    order = RUN_ORDER
    if wildcards.experiment == "e2e" and TUNED:  # a tuned case runs beside its point's others
        order = plan.run_order({**CASES, "e2e": e2e_cases()})
    return order.get((wildcards.experiment, wildcards.case_id), 0)


def case_inputs(wildcards):
    return sources.case_sources(case_of(wildcards), code=CASE_CODE)


def job_case(wildcards):
    tuning = None  # a tuning's trials take its steps and warm-up
    if wildcards.experiment.startswith("autotune/"):
        tuning = TUNINGS[wildcards.experiment.removeprefix("autotune/")]
    return plan.job_case(case_of(wildcards), PROFILE, tuning).to_json()


def case_gpus(wildcards):
    return plan.gpus_resource(case_of(wildcards), PROFILE)


def workflow_cores():
    """The cores the workflow may use (``--cores``; the profiles give all), or None where the
    command gives none and runs no job (``snakemake --unlock``, ``--report``): the planner
    then counts this machine's. ``workflow.cores`` itself raises there."""
    try:
        return workflow.cores
    except WorkflowError:
        return None


def all_cores(wildcards):
    """The threads of a job that holds the machine as a case does: every core."""
    return plan.machine_cores(workflow_cores())


def case_threads(wildcards):
    return plan.threads(case_of(wildcards), PROFILE, workflow_cores())


def case_rank_cores(wildcards):
    return plan.rank_cores(case_of(wildcards), PROFILE, workflow_cores())


def case_gpu_request(wildcards):
    return plan.gpu_request(case_of(wildcards), PROFILE)


def case_node_resource(name):
    """The resource ``name`` that places a case on its nodes (plan.node_resources; None, and
    so no resource, for a case on one node)."""

    def resource(wildcards):
        return plan.node_resources(case_of(wildcards), PROFILE, config, workflow_cores())[name]

    return resource


def records(experiment):
    """The records an aggregate reads: every case of the experiment in the active profile."""
    return [
        f"results/{experiment}/{PROFILE['name']}/{case_id}.json"
        for case_id in CASES[experiment]
    ]


def e2e_records(wildcards=None):
    """The e2e records; with ``--config tuned=true`` the tuned cases in place of theirs (known
    once the tunings are done: e2e_cases below)."""
    if not TUNED:
        return records("e2e")
    return [f"results/e2e/{PROFILE['name']}/{case_id}.json" for case_id in e2e_cases()]


def table4_inputs(wildcards):
    """The schedules Table 4 counts, and the analysis that counts them."""
    return sorted(sources.schedule_files().values()) + sources.analysis_sources("table4")


def smoke_case():
    """kick_the_tires' smoke case, on CUDA where the machine has its GPUs, else on CPU ranks
    (a one-GPU machine: the case's two ranks would not fit, and it would be unsupported)."""
    kick = config["kick_the_tires"]
    case = parse_cfg_text(kick["smoke_case"], "kick_the_tires.smoke_case")[0]
    device = "cuda" if PROFILE["gpus_available"] >= case.gpus else "cpu"
    return case.for_run(kick["steps"], kick["warmup"], "fp32", device)


# -- the tunings (autotune.smk): rounds are checkpoints, read here once they have run --------

def tuning_records_dir(tuning):
    return f"results/{plan.tuning_experiment(tuning)}/{PROFILE['name']}"


def round_file(tuning, strategy, k):
    return f"{tuning_records_dir(tuning)}/{strategy}/round{k}.json"


def read_round(tuning, strategy, k):
    """Round k of a tuning's strategy, once its checkpoint has run (else Snakemake runs it)."""
    out = checkpoints.autotune_round.get(tuning=tuning, profile=PROFILE["name"],
                                         strategy=strategy, k=k).output[0]
    return json.loads(Path(out).read_text())


def final_round(tuning, strategy):
    """The number of the round that proposed nothing (rounds are made one after another)."""
    k = 0
    while not read_round(tuning, strategy, k)["done"]:
        k += 1
    return k


def trial_records(tuning, data):
    """The records a round file names: the trials so far and the next ones."""
    return [f"{tuning_records_dir(tuning)}/{e['case_id']}.json"
            for e in data["trials"] + data["next"]]


def autotune_round_inputs(wildcards):
    inputs = {"spec": TUNINGS[wildcards.tuning].path,
              "code": sources.tuning_sources()}
    k = int(wildcards.k)
    if k > 0:
        inputs["previous"] = round_file(wildcards.tuning, wildcards.strategy, k - 1)
        inputs["records"] = trial_records(
            wildcards.tuning, read_round(wildcards.tuning, wildcards.strategy, k - 1))
    return inputs


def previous_option(wildcards, input):
    previous = input.get("previous")  # absent in round 0 (and while round k - 1 is pending)
    return f"--previous {previous}" if previous else ""


def autotune_table_inputs(wildcards):
    rounds, records = [], set()
    for name, spec in TUNINGS.items():
        for strategy in spec.strategies:
            k = final_round(name, strategy)
            rounds.append(round_file(name, strategy, k))
            records.update(trial_records(name, read_round(name, strategy, k)))
    return {"rounds": rounds, "records": sorted(records),
            "specs": [spec.path for spec in TUNINGS.values()],
            "code": sources.analysis_sources("autotune")}


def chosen_cases():
    """Each tuning's chosen case (the best of its first strategy), once the tunings are done."""
    chosen = []
    for name, spec in TUNINGS.items():
        best = read_round(name, spec.strategies[0], final_round(name, spec.strategies[0]))["best"]
        if best is not None:
            chosen.append(spec.case_for(best["config"]))
    return chosen


def e2e_cases():
    """The e2e cases of the profile with the tuned cases in place (``--config tuned=true``)."""
    return plan.tuned_e2e(CASES["e2e"], chosen_cases())


def autotune_outputs():
    if not TUNINGS:
        return []
    return ["results/autotune.csv", "results/autotune.json", "results/autotune.cfg",
            "figures/autotune.pdf"]
