# `snakemake --report report.html`: the figures, tables and claims with their captions.
# Each output marked with report() in the rule files appears there; this adds the front page.


report: "../report/workflow.rst"
