# kick_the_tires: a quick test subset plus one smoke case, ending in one verdict line
# (KICK-THE-TIRES: PASS / FAIL) in results/kick_the_tires.txt. No output file is declared, so
# the target runs afresh each time it is asked for.


rule kick_the_tires:
    log:
        "results/kick_the_tires/kick.log",
    params:
        case=smoke_case().to_json(),
        case_timeout=config["kick_the_tires"]["timeout"],
        harness=config["harness"],
        timeout=config["kick_the_tires"]["test_timeout"],
        pytest=shlex.join(config["kick_the_tires"]["pytest_args"]),
    resources:
        gpus=smoke_case().gpus if smoke_case().device == "cuda" else 0,
    conda:
        ENV
    shell:
        "python -m slapo_ae.analysis.kick "
        "--case {params.case:q} --timeout {params.case_timeout} --out results/kick_the_tires.txt "
        "--record results/kick_the_tires/smoke.json --log results/kick_the_tires/smoke.log "
        "--test-log results/kick_the_tires/pytest.log --test-timeout {params.timeout} "
        "--harness {params.harness:q} -- {params.pytest} 2> {log}"
