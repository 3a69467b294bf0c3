# Table 4: lines of schedule code per model, beside the paper's numbers.


rule table4:
    input:
        table4_inputs,
    output:
        csv="results/loc.csv",
        md=report(
            "figures/table4.md",
            caption="../report/table4.rst",
            category="Table 4: lines of schedule code",
        ),
        tex="figures/table4.tex",
    log:
        "results/logs/table4.log",
    conda:
        ENV
    shell:
        "python -m slapo_ae.analysis.table4 --csv {output.csv} "
        "--md {output.md} --tex {output.tex} > {log} 2>&1"
