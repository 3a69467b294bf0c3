# Figure 10: the autotuner. Each tuning (configs/autotune/<name>.yaml, listed by the profile)
# runs its strategies in rounds; each trial is a case (rule `case`, experiment
# autotune/<name>), so it is cached like any case and an OOM is a record too. A round is a
# checkpoint: its job reads the records of the trials so far and decides the next ones
# (slapo_ae.harness.tune, with slapo.autotune); the planner only reads the round files.
#
#   results/autotune/<name>/<profile>/<case-id>.json            a trial's record
#   results/autotune/<name>/<profile>/<strategy>/round<k>.json  round k: trials so far, next
#   results/autotune.csv, results/autotune.json, results/autotune.cfg, figures/autotune.pdf


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
    return f"--previous {input.previous}" if int(wildcards.k) > 0 else ""


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


checkpoint autotune_round:
    input:
        unpack(autotune_round_inputs),
    output:
        "results/autotune/{tuning}/{profile}/{strategy}/round{k}.json",
    log:
        "results/autotune/{tuning}/{profile}/{strategy}/logs/round{k}.log",
    params:
        records=lambda wildcards: tuning_records_dir(wildcards.tuning),
        previous=previous_option,
    wildcard_constraints:
        tuning="[A-Za-z][A-Za-z0-9_.-]*",
        profile=PROFILE["name"],
        strategy="prune|grid",
        k="[0-9]+",
    # it imports torch (slapo): on CPU it holds the cores, as a case does, so that no case
    # measures beside it
    threads: workflow.cores if PROFILE["device"] == "cpu" else 1
    conda:
        ENV
    shell:
        "python -m slapo_ae.harness.tune --spec {input.spec} --strategy {wildcards.strategy} "
        "--round {wildcards.k} --records {params.records} {params.previous} --out {output} "
        "> {log} 2>&1"


rule autotune_table:
    input:
        unpack(autotune_table_inputs),
    output:
        csv=report(
            "results/autotune.csv",
            caption="../report/autotune_table.rst",
            category="Figure 10: autotuning",
        ),
        json="results/autotune.json",
        cfg="results/autotune.cfg",
    log:
        "results/logs/autotune_table.log",
    conda:
        ENV
    shell:
        "python -m slapo_ae.analysis.autotune table --csv {output.csv} --json {output.json} "
        "--cfg {output.cfg} {input.rounds} > {log} 2>&1"


rule autotune_figure:
    input:
        json="results/autotune.json",
        code=sources.analysis_sources("autotune"),
    output:
        report(
            "figures/autotune.pdf",
            caption="../report/autotune.rst",
            category="Figure 10: autotuning",
        ),
    log:
        "results/logs/autotune_figure.log",
    conda:
        ENV
    shell:
        "python -m slapo_ae.analysis.autotune figure {input.json} {output} > {log} 2>&1"
