"""What reruns after what: nothing after a complete run; one case after one cfg line; the
dependent cases after the harness or a schedule; nothing but the aggregates after an
analysis module. Checked by dry runs on a copy of a completed run (fake harness)."""
import pytest
from wf_util import ABLATION_CASES, E2E_CASES, make_config

pytestmark = pytest.mark.slow

AGGREGATES_E2E = {"e2e_table", "e2e_figure", "recheck", "gaps", "claims", "all"}


def _edit(path, old, new):
    text = path.read_text()
    assert old in text, old
    path.write_text(text.replace(old, new, 1))


def test_complete_run_has_every_output(done_repo):
    assert len(done_repo.records("e2e")) == E2E_CASES
    assert len(done_repo.records("ablation")) == ABLATION_CASES
    for rel in ("results/e2e.csv", "figures/e2e.pdf", "results/ablation.csv",
                "figures/ablation.pdf", "results/multinode.csv", "figures/multinode.pdf",
                "results/loc.csv", "figures/table4.md",
                "figures/table4.tex", "results/gaps.json", "results/claims.md",
                "results/claims.json"):
        assert (done_repo.path / rel).is_file(), rel
    logs = list((done_repo.path / "results" / "e2e" / "test" / "logs").glob("*.log"))
    assert len(logs) == E2E_CASES


def test_second_run_does_nothing(done_repo):
    proc = done_repo.snakemake("-n")
    assert "Nothing to be done" in proc.stdout + proc.stderr
    assert done_repo.dry_run() == {}


def test_editing_one_cfg_line_reruns_that_case_and_the_aggregates(done_repo):
    cfg = done_repo.path / "configs" / "e2e" / "test.cfg"
    before = {p.name: p.stat().st_mtime_ns for p in done_repo.records("e2e")}
    _edit(cfg, "deepspeed       gpt-neo-tiny 1   64 0 2   0",
          "deepspeed       gpt-neo-tiny 1   64 0 4   0")
    # comments and moved lines change nothing
    cfg.write_text("# a new first line\n" + cfg.read_text() + "# trailing comment\n")
    jobs = done_repo.dry_run()
    assert done_repo.pending_cases() == {"deepspeed__gpt-neo-tiny__g1__s64__b4__c0"}
    assert set(jobs) == {"case"} | AGGREGATES_E2E
    done_repo.snakemake()
    after = {p.name: p.stat().st_mtime_ns for p in done_repo.records("e2e")}
    unchanged = {name for name in before if after.get(name) == before[name]}
    assert unchanged == set(before)  # no other record rewritten
    assert set(after) - set(before) == {"deepspeed__gpt-neo-tiny__g1__s64__b4__c0.json"}
    csv = (done_repo.path / "results" / "e2e.csv").read_text()
    assert "deepspeed__gpt-neo-tiny__g1__s64__b4__c0" in csv
    assert ",deepspeed__gpt-neo-tiny__g1__s64__b2__c0," not in csv  # the old line's case left
    assert done_repo.dry_run() == {}


def test_deleting_a_record_reruns_that_case_and_the_aggregates(done_repo):
    """The documented way to force a case again: its record, then every aggregate that read
    it, are made anew; nothing goes on showing the deleted record's numbers."""
    case_id = "deepspeed__gpt-neo-tiny__g1__s64__b2__c0"
    done_repo.record("e2e", case_id).unlink()
    assert done_repo.pending_cases() == {case_id}
    assert set(done_repo.dry_run()) == {"case"} | AGGREGATES_E2E
    done_repo.snakemake()
    assert done_repo.record("e2e", case_id).is_file()
    assert done_repo.dry_run() == {}


def test_editing_the_harness_reruns_every_case(done_repo):
    record = done_repo.path / "slapo_ae" / "record.py"
    record.write_text(record.read_text() + "\n# edited\n")
    assert len(done_repo.pending_cases()) == E2E_CASES + ABLATION_CASES


def test_editing_a_schedule_reruns_only_its_slapo_cases(done_repo):
    bert = done_repo.path / "slapo" / "model_schedule" / "bert.py"
    bert.write_text(bert.read_text() + "\n# edited\n")
    pending = done_repo.pending_cases()
    assert pending == {
        "slapo-megatron__bert-tiny__g1__s64__b2__c0", "slapo-megatron__bert-tiny__g2__s64__b4__c0",
        "slapo-deepspeed__bert-tiny__g1__s64__b2__c0",
        "slapo-deepspeed__bert-tiny__g2__s64__b4__c0",
        "slapo-kernel__bert-tiny__g1__s64__b2__c0", "slapo-tp-attn-ffn__bert-tiny__g2__s64__b4__c0",
        "slapo-tp-full__bert-tiny__g2__s64__b4__c0"}
    # Table 4 counts the schedules, so it is redone as well
    assert "table4" in done_repo.dry_run()


def test_touching_without_change_reruns_nothing(done_repo):
    (done_repo.path / "slapo_ae" / "record.py").touch()
    assert done_repo.dry_run() == {}


def test_editing_an_analysis_module_reruns_only_aggregates(done_repo):
    plots = done_repo.path / "slapo_ae" / "analysis" / "plots.py"
    plots.write_text(plots.read_text() + "\n# edited\n")
    jobs = done_repo.dry_run()
    assert "case" not in jobs
    assert set(jobs) == {"e2e_figure", "multinode_figure", "ablation_figure", "all"}


def test_changing_profile_settings_reruns_every_case(done_repo):
    """The run settings are params: a new step count reruns all cases (params trigger); the
    timeout is a resource, and raising it reruns nothing."""
    done_repo.write_config(make_config(done_repo.path, timeout=999))
    assert done_repo.dry_run() == {}
    done_repo.write_config(make_config(done_repo.path, steps=4))
    assert len(done_repo.pending_cases()) == E2E_CASES + ABLATION_CASES
