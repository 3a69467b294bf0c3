# Claims C1-C4 of the paper, each PASS / FAIL / INCONCLUSIVE / NOT-RUN per data point, with its
# numbers (C2's multi-node half from Figure 8's cases); and Slapo beside its own engine,
# profiled where it is behind. Close comparisons are measured again back to back first
# (recheck), so that no verdict rests on the drift between runs minutes apart.


rule recheck:
    input:
        e2e="results/e2e.csv",
        ablation="results/ablation.csv",
        code=sources.analysis_sources("recheck"),
    output:
        "results/recheck.json",
    params:
        device=PROFILE["device"],
        dtype=PROFILE["dtype"],
        steps=PROFILE["steps"],
        warmup=PROFILE["warmup"],
        below=config["claims"]["recheck_below"],
        most=config["claims"]["max_rechecks"],
        budget=" ".join(
            f"--{flag} {PROFILE[key]}" for flag, key in (
                ("budget-s", "recheck_budget_s"), ("time-target-s", "time_target_s"),
                ("reserved-s", "time_reserved_s"))
            if PROFILE[key] is not None),
        reruns="" if PROFILE["reruns"] else "--no-reruns",
        harness=config["harness"],
    # it reruns cases: it holds the machine as a case does (gpus: packing here; gpu: Slurm's
    # request)
    threads: all_cores
    # a rerun's time limit is a resource, as a case's: raising it reruns nothing
    resources:
        gpus=plan.machine_job_gpus(PROFILE)[0],
        gpu=plan.machine_job_gpus(PROFILE)[1],
        timeout_s=PROFILE["timeout"],
    log:
        "results/logs/recheck.log",
    conda:
        ENV
    shell:
        "python -m slapo_ae.analysis.recheck --e2e {input.e2e} "
        "--ablation {input.ablation} --out {output} --runs results/recheck "
        "--steps {params.steps} --warmup {params.warmup} --below {params.below} "
        "--max {params.most} {params.budget} --device {params.device} --dtype {params.dtype} "
        "--timeout {resources.timeout_s} {params.reruns} --harness {params.harness:q} > {log} 2>&1"


rule gaps:
    input:
        e2e="results/e2e.csv",
        ablation="results/ablation.csv",
        recheck="results/recheck.json",
        code=sources.analysis_sources("gaps"),
    output:
        "results/gaps.json",
    params:
        device=PROFILE["device"],
        dtype=PROFILE["dtype"],
        max_profiles="" if PROFILE["reruns"] else "--max-profiles 0",
        harness=config["harness"],
    # it reruns cases under the profiler: it holds the machine as a case does (the harness
    # gives their ranks one core each on CPU, as in the cases)
    threads: all_cores
    # a rerun's time limit is a resource, as a case's: raising it reruns nothing
    resources:
        gpus=plan.machine_job_gpus(PROFILE)[0],
        gpu=plan.machine_job_gpus(PROFILE)[1],
        timeout_s=PROFILE["timeout"],
    log:
        "results/logs/gaps.log",
    conda:
        ENV
    shell:
        "python -m slapo_ae.analysis.gaps --e2e {input.e2e} "
        "--ablation {input.ablation} --recheck {input.recheck} --out {output} "
        "--profiles results/profiles --device {params.device} --dtype {params.dtype} "
        "--timeout {resources.timeout_s} {params.max_profiles} --harness {params.harness:q} "
        "> {log} 2>&1"


rule claims:
    input:
        e2e="results/e2e.csv",
        ablation="results/ablation.csv",
        multinode="results/multinode.csv",
        loc="results/loc.csv",
        gaps="results/gaps.json",
        recheck="results/recheck.json",
        code=sources.analysis_sources("claims"),
    output:
        md=report(
            "results/claims.md",
            caption="../report/claims.rst",
            category="Claims",
        ),
        json="results/claims.json",
    params:
        c2=config["claims"]["c2_min_speedup"],
        c3=config["claims"]["c3_max_ratio"],
    log:
        "results/logs/claims.log",
    conda:
        ENV
    shell:
        "python -m slapo_ae.analysis.claims --e2e {input.e2e} "
        "--ablation {input.ablation} --multinode {input.multinode} --loc {input.loc} "
        "--gaps {input.gaps} --recheck {input.recheck} --md {output.md} "
        "--json {output.json} "
        "--c2-min-speedup {params.c2} --c3-max-ratio {params.c3} > {log} 2>&1"
