# Config, profile and cases: the helpers every rule file uses (no rules here).
import json
import shlex
import sys
from pathlib import Path

from snakemake.utils import min_version, validate

min_version("9.0")

sys.path.insert(0, str(Path(workflow.basedir) / "workflow" / "scripts"))

from run_module import light_slapo

light_slapo()  # this checkout's slapo.bench, without loading torch at DAG time

from slapo.bench.workflow import plan


validate(config, schema="../schemas/config.schema.yaml", set_default=True)

plan.python_on_path()  # jobs' `python` is the interpreter running Snakemake
PROFILE = plan.resolve(config)
CASES = plan.load_cases(PROFILE)  # {experiment: {case_id: Case}}
HARNESS_FILES = plan.harness_files()
ENV = "../envs/slapo.yaml"
plan.export_slots(config, PROFILE)  # GPU slot folder and count, for the jobs' environment

if PROFILE["warmup"] >= PROFILE["steps"]:
    raise ValueError(
        f"profile {PROFILE['name']}: warmup ({PROFILE['warmup']}) must be below steps "
        f"({PROFILE['steps']}): no timed step would remain"
    )


def case_of(wildcards):
    try:
        return CASES[wildcards.experiment][wildcards.case_id]
    except KeyError:
        raise ValueError(
            f"no case {wildcards.case_id!r} in experiment {wildcards.experiment!r} of "
            f"profile {PROFILE['name']!r}"
        ) from None


def case_inputs(wildcards):
    return plan.case_inputs(case_of(wildcards), harness=HARNESS_FILES)


def case_spec(wildcards):
    return plan.case_spec_json(case_of(wildcards), PROFILE)


def case_gpus(wildcards):
    return plan.gpus_resource(case_of(wildcards), PROFILE)


def case_threads(wildcards):
    return plan.threads(case_of(wildcards), PROFILE, workflow.cores)


def case_rank_cores(wildcards):
    return plan.rank_cores(case_of(wildcards), PROFILE, workflow.cores)


def records(experiment):
    """The records an aggregate reads: every case of the experiment in the active profile."""
    return [
        f"results/{experiment}/{PROFILE['name']}/{case_id}.json"
        for case_id in CASES[experiment]
    ]


def table4_inputs(wildcards):
    """The schedules Table 4 counts, and the counter itself where it exists."""
    files = sorted(plan.schedule_files().values()) + ["slapo/bench/table4.py"]
    return files + [f for f in ["slapo/model_schedule/loc.py"] if Path(f).is_file()]


def smoke_spec():
    kick = config["kick_the_tires"]
    settings = {
        "device": "cuda" if PROFILE["gpus_available"] else "cpu",
        "dtype": "fp32",
        "steps": kick["steps"],
        "warmup": kick["warmup"],
    }
    case = plan.parse_cfg_text(kick["smoke_case"], "kick_the_tires.smoke_case")[0]
    spec = plan.case_spec(case, settings)
    return json.dumps({**spec, "timeout": kick["timeout"]}, sort_keys=True)
