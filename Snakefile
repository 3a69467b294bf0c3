# The artifact-evaluation workflow of Slapo (ASPLOS'24): Figures 7, 8, 9 and 10 (the
# autotuner), Table 4 and the paper's claims, for the cases of the active profile
# (configs/config.yaml).
#
#   snakemake --workflow-profile workflow/profiles/default          everything (rule all)
#   snakemake --workflow-profile workflow/profiles/default --config profile=cpu
#   snakemake --workflow-profile workflow/profiles/default kick_the_tires
#   snakemake --report report.html                                   figures and tables
#
# Rules live in workflow/rules/*.smk; their logic in workflow/plan.py and the artifact package
# slapo_ae (importable, tested). common.smk reads configs/config.yaml.


include: "workflow/rules/common.smk"
include: "workflow/rules/cases.smk"
include: "workflow/rules/e2e.smk"
include: "workflow/rules/ablation.smk"
include: "workflow/rules/multinode.smk"
include: "workflow/rules/loc.smk"
include: "workflow/rules/claims.smk"
include: "workflow/rules/autotune.smk"
include: "workflow/rules/tests.smk"
include: "workflow/rules/report.smk"


rule all:
    input:
        "results/e2e.csv",
        "figures/e2e.pdf",
        "results/ablation.csv",
        "figures/ablation.pdf",
        "results/multinode.csv",
        "figures/multinode.pdf",
        "results/loc.csv",
        "figures/table4.md",
        "figures/table4.tex",
        "results/claims.md",
        "results/claims.json",
        # Figure 10, where the profile has tunings
        autotune_outputs(),
        # every record a target too: a deleted record is made again (and the aggregates after
        # it), where as an intermediate file alone Snakemake would leave it missing
        e2e_records,
        records("ablation"),
        records("multinode"),
    default_target: True
