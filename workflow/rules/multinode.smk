# Figure 8: the cases of the profile on several nodes -> results/multinode.csv ->
# figures/multinode.pdf (empty, saying so, in a profile without multi-node cases).


rule multinode_table:
    input:
        records=records("multinode"),
        code=sources.analysis_sources("aggregate"),
    output:
        report(
            "results/multinode.csv",
            caption="../report/multinode_table.rst",
            category="Figure 8: multi-node throughput",
        ),
    log:
        "results/logs/multinode_table.log",
    conda:
        ENV
    shell:
        "python -m slapo_ae.analysis.aggregate --experiment multinode "
        "--out {output} {input.records} > {log} 2>&1"


rule multinode_figure:
    input:
        csv="results/multinode.csv",
        code=sources.analysis_sources("plots"),
    output:
        report(
            "figures/multinode.pdf",
            caption="../report/multinode.rst",
            category="Figure 8: multi-node throughput",
        ),
    log:
        "results/logs/multinode_figure.log",
    conda:
        ENV
    shell:
        "python -m slapo_ae.analysis.plots multinode {input.csv} {output} "
        "> {log} 2>&1"
