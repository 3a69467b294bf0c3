# Figure 9: the ablation steps of the profile -> results/ablation.csv -> figures/ablation.pdf.


rule ablation_table:
    input:
        records=records("ablation"),
        code=sources.analysis_sources("aggregate"),
    output:
        report(
            "results/ablation.csv",
            caption="../report/ablation_table.rst",
            category="Figure 9: ablation",
        ),
    log:
        "results/logs/ablation_table.log",
    conda:
        ENV
    shell:
        "python -m slapo_ae.analysis.aggregate --experiment ablation "
        "--out {output} {input.records} > {log} 2>&1"


rule ablation_figure:
    input:
        csv="results/ablation.csv",
        code=sources.analysis_sources("plots"),
    output:
        report(
            "figures/ablation.pdf",
            caption="../report/ablation.rst",
            category="Figure 9: ablation",
        ),
    log:
        "results/logs/ablation_figure.log",
    conda:
        ENV
    shell:
        "python -m slapo_ae.analysis.plots ablation {input.csv} {output} "
        "> {log} 2>&1"
