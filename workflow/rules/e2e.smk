# Figure 7: every e2e case of the profile -> results/e2e.csv -> figures/e2e.pdf.


rule e2e_table:
    input:
        records=e2e_records,
        code=sources.analysis_sources("aggregate"),
    output:
        report(
            "results/e2e.csv",
            caption="../report/e2e_table.rst",
            category="Figure 7: end-to-end throughput",
        ),
    log:
        "results/logs/e2e_table.log",
    conda:
        ENV
    shell:
        "python -m slapo_ae.analysis.aggregate --experiment e2e "
        "--out {output} {input.records} > {log} 2>&1"


rule e2e_figure:
    input:
        csv="results/e2e.csv",
        code=sources.analysis_sources("plots"),
    output:
        report(
            "figures/e2e.pdf",
            caption="../report/e2e.rst",
            category="Figure 7: end-to-end throughput",
        ),
    log:
        "results/logs/e2e_figure.log",
    conda:
        ENV
    shell:
        "python -m slapo_ae.analysis.plots e2e {input.csv} {output} "
        "> {log} 2>&1"
