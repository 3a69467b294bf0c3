# One job per benchmark case: results/<experiment>/<profile>/<case-id>.json plus its log.
# The case's fields are params (not the cfg file), the code it runs is input: editing one cfg
# line reruns that case only; editing the harness or a schedule reruns the cases using it.


rule case:
    output:
        record="results/{experiment}/{profile}/{case_id}.json",
    input:
        case_inputs,
    log:
        "results/{experiment}/{profile}/logs/{case_id}.log",
    params:
        case=job_case,
        harness=config["harness"],
    wildcard_constraints:
        # a tuning's trials: autotune/<tuning> (autotune.smk)
        experiment="e2e|ablation|multinode|autotune/[A-Za-z][A-Za-z0-9_.-]*",
        profile=PROFILE["name"],
        case_id="[^/]+",
    threads: case_threads
    # compared cases run one after another (plan.run_order)
    priority: case_priority
    resources:
        # gpus: packs jobs onto a node under `--resources gpus=N`; gpu: the same request under
        # the name the Slurm executor plugin reads (one node; on several, gres per machine)
        gpus=case_gpus,
        gpu=case_gpu_request,
        # a case on several nodes: the machines, and under srun one Slurm task per node's
        # agent (plan.node_resources); none of these for a case on one node
        nodes=case_node_resource("nodes"),
        tasks=case_node_resource("tasks"),
        mpi=case_node_resource("mpi"),
        cpus_per_task=case_node_resource("cpus_per_task"),
        gres=case_node_resource("gres"),
        tasks_per_gpu=case_node_resource("tasks_per_gpu"),
        # the case's time limit (s); runtime: the same plus the runner's grace, in minutes,
        # for cluster schedulers. Resources, not params: raising them reruns nothing.
        timeout_s=PROFILE["timeout"],
        # cores the case's ranks share (one per rank on CPU, where the job holds them all)
        rank_cores=case_rank_cores,
        runtime=plan.runtime_minutes(PROFILE),
    conda:
        ENV
    shell:
        # exec: the runner is Snakemake's own child, and ends when Snakemake is killed
        "exec python -m slapo_ae.harness.runner "
        "--case {params.case:q} --timeout {resources.timeout_s} --cores {resources.rank_cores} "
        "--harness {params.harness:q} "
        "--out {output.record} --log {log}"
