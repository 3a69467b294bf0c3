# Claims C1-C4 of the paper, each PASS / FAIL / NOT-RUN per data point, with its numbers.


rule claims:
    input:
        e2e="results/e2e.csv",
        ablation="results/ablation.csv",
        loc="results/loc.csv",
        code="slapo/bench/claims.py",
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
        "python workflow/scripts/run_module.py slapo.bench.claims --e2e {input.e2e} "
        "--ablation {input.ablation} --loc {input.loc} --md {output.md} --json {output.json} "
        "--c2-min-speedup {params.c2} --c3-max-ratio {params.c3} > {log} 2>&1"
