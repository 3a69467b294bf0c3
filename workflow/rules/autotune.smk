# Figure 10: the autotuner. Each tuning (configs/autotune/<name>.yaml, listed by the profile)
# runs its strategies in rounds; each trial is a case (rule `case`, experiment
# autotune/<name>), so it is cached like any case and an OOM is a record too. A round is a
# checkpoint: its job reads the records of the trials so far and decides the next ones
# (slapo_ae.harness.tune, with slapo.autotune); the planner only reads the round files.
#
#   results/autotune/<name>/<profile>/<case-id>.json            a trial's record
#   results/autotune/<name>/<profile>/<strategy>/round<k>.json  round k: trials so far, next
#   results/autotune.csv, results/autotune.json, results/autotune.cfg, figures/autotune.pdf
#
# The helpers (round files, the inputs of each round, the chosen cases) are in common.smk.


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
    threads: all_cores if PROFILE["device"] == "cpu" else 1
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
    params:
        # a dry run formats the command before the rounds have run (no `rounds` input yet)
        rounds=lambda wildcards, input: input.get("rounds", []),
    conda:
        ENV
    shell:
        "python -m slapo_ae.analysis.autotune table --csv {output.csv} --json {output.json} "
        "--cfg {output.cfg} {params.rounds} > {log} 2>&1"


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
