"""Failures are data: a failing case is a row with its status and an X in the figure, and the
figures and claims of the other cases are still made."""
import json

import pandas as pd
import pytest
from wf_util import x_marks

from slapo_ae.analysis import plots
from slapo_ae.record import read_record

pytestmark = pytest.mark.slow


def test_failing_cases_give_rows_and_x_marks(repo):
    repo.plan({
        "slapo-megatron__bert-tiny__g2__s64__b4__c0": {"status": "failed",
                                                        "reason": "planned failure"},
        "megatron__bert-tiny__g2__s64__b4__c0": {"status": "oom", "reason": "planned OOM"},
        "deepspeed__gpt-neo-tiny__g1__s64__b2__c0": {"crash": True},  # no record from harness
        "slapo-tp-full__bert-tiny__g2__s64__b4__c0": {"crash": True},
    })
    repo.snakemake()
    crashed = read_record(repo.record("e2e", "deepspeed__gpt-neo-tiny__g1__s64__b2__c0"))
    assert crashed.status == "failed" and "exited with code 1" in crashed.reason

    e2e = pd.read_csv(repo.path / "results" / "e2e.csv")
    status = dict(zip(e2e["case_id"], e2e["status"]))
    assert status["slapo-megatron__bert-tiny__g2__s64__b4__c0"] == "failed"
    assert status["megatron__bert-tiny__g2__s64__b4__c0"] == "oom"
    assert status["deepspeed__gpt-neo-tiny__g1__s64__b2__c0"] == "failed"
    assert (e2e["status"] == "ok").sum() == len(e2e) - 3
    for rel in ("figures/e2e.pdf", "figures/ablation.pdf", "results/claims.md"):
        assert (repo.path / rel).stat().st_size > 0
    # the figure drawn from that table has one X per non-ok case
    fig = plots.figure7(e2e)
    assert x_marks(fig) == 3
    ablation = pd.read_csv(repo.path / "results" / "ablation.csv")
    assert x_marks(plots.figure9(ablation)) == 1

    claims = json.loads((repo.path / "results" / "claims.json").read_text())
    c4 = {c["id"]: c for c in claims["claims"]}["C4"]
    # the last step crashed where the one before ran: a failed step, not a missing one
    assert [p["verdict"] for p in c4["points"]] == ["PASS", "PASS", "FAIL"]
    assert c4["verdict"] == "FAIL"
    # gpt-neo-tiny on 1 rank: the baseline crashed, Slapo-ZeRO3 ran -> C1 passes there
    c1 = {(p["model"], p["gpus"]): p for p in claims["claims"][0]["points"]}
    assert c1[("gpt-neo-tiny", 1)]["verdict"] == "PASS"
    assert repo.dry_run() == {}  # failed cases are results, not pending work
