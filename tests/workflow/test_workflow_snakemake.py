"""The workflow as Snakemake sees it: lint, config validation, the paper DAG, the report."""
import json

import plan
import pytest
import yaml
from wf_util import REPO, make_repo

pytestmark = pytest.mark.slow


def test_lint_is_clean(repo):
    proc = repo.snakemake("--lint", profile=False, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "Congratulations, your workflow is in a good condition!" in out
    assert "Lints for" not in out


def refused(proc) -> list[str]:
    """The error lines of a workflow that refused its input: exit status 2, no traceback."""
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and 'File "' not in proc.stderr, proc.stderr[-2000:]
    return [line for line in proc.stderr.splitlines() if line.startswith("error: ")]


def test_config_is_validated_at_start(repo):
    config = yaml.safe_load((repo.path / "configs" / "config.yaml").read_text())
    config["profiles"]["test"]["dtype"] = "fp8"
    repo.write_config(config)
    assert refused(repo.snakemake("-n", check=False)) == [
        "error: configs/config.yaml (or --config): profiles.test.dtype: 'fp8' is not one of "
        "['fp32', 'fp16', 'bf16']"]


def test_warmup_not_below_steps_is_refused_at_start(repo):
    config = yaml.safe_load((repo.path / "configs" / "config.yaml").read_text())
    config["profiles"]["test"].update(steps=3, warmup=3)
    repo.write_config(config)
    assert refused(repo.snakemake("-n", check=False)) == [
        "error: profile test: warmup (3) must be below steps (3): no timed step would remain"]


@pytest.mark.parametrize("override, says", [
    ("profile=nope", "error: profile 'nope' is not defined in the config; defined: "),
    ("gpus=lots", "error: configs/config.yaml (or --config): gpus: "),
    # Snakemake reads the values inside a --config mapping as strings: say so, not just
    # that '5' is not a number
    ('profiles={"test":{"steps":5}}', "error: configs/config.yaml (or --config): "
     "profiles.test.steps: '5' is not of type 'integer' (Snakemake reads a value inside a "
     "--config mapping as a string: set it in configs/config.yaml or a --configfile)"),
])
def test_config_overrides_are_refused_in_one_line(repo, override, says):
    errors = refused(repo.snakemake("-n", "--config", override, check=False))
    assert len(errors) == 1 and errors[0].startswith(says), errors


def test_broken_yaml_is_named_by_file_and_line(repo):
    path = repo.path / "configs" / "config.yaml"
    path.write_text(path.read_text() + "profile: [cpu\nsteps: 3\n")
    lines = path.read_text().count("\n")
    errors = refused(repo.snakemake("-n", check=False))
    assert len(errors) == 1 and errors[0].startswith(f"error: configs/config.yaml:{lines}:")
    assert "not valid YAML" in errors[0]


def test_a_config_or_cfg_that_is_not_text_is_named_by_file_and_byte(repo):
    path = repo.path / "configs" / "config.yaml"
    text = path.read_bytes()
    path.write_bytes(text + b"# \xff\n")
    assert refused(repo.snakemake("-n", check=False)) == [
        f"error: configs/config.yaml: not UTF-8 text: byte 0xff at offset {len(text) + 2} cannot "
        "be decoded (invalid start byte)"]
    path.write_bytes(text)
    cfg = repo.path / "configs" / "e2e" / "test.cfg"
    cfg.write_bytes(cfg.read_bytes() + b"\x00\x9c")
    errors = refused(repo.snakemake("-n", check=False))
    assert len(errors) == 1 and errors[0].startswith(
        "error: configs/e2e/test.cfg: not UTF-8 text: byte 0x9c at offset ")


def test_bad_cfg_line_stops_the_dag_with_file_and_line(repo):
    cfg = repo.path / "configs" / "e2e" / "test.cfg"
    cfg.write_text(cfg.read_text() + "slapo-megatorn bert-tiny 2 64 0 4 0\n")
    errors = refused(repo.snakemake("-n", check=False))
    assert errors[0].startswith("error: configs/e2e/test.cfg:8: unknown mode 'slapo-megatorn'")


def test_paper_dag_has_every_figure7_and_figure9_case(tmp_path):
    """The real config: `profile=paper` on an 8-GPU machine plans 72 + 4 cases."""
    repo = make_repo(tmp_path / "repo")
    (repo.path / "configs" / "config.yaml").write_text(
        (REPO / "configs" / "config.yaml").read_text())
    jobs = repo.dry_run("--config", "profile=paper", "gpus=8")
    cases = jobs["case"]
    assert len(cases) == 76
    assert sum(c.startswith("results/e2e/paper/") for c in cases) == 72
    assert sum(c.startswith("results/ablation/paper/") for c in cases) == 4
    assert "results/e2e/paper/slapo-deepspeed__wideresnet-2.4B__g8__s1__b264__c0.json" in cases
    assert {"e2e_table", "e2e_figure", "ablation_table", "ablation_figure", "table4",
            "recheck", "gaps", "claims", "all"} <= set(jobs)


def test_report_has_figures_tables_and_captions(done_repo):
    done_repo.snakemake("--report", "report.html", profile=False)  # as the README says
    html = (done_repo.path / "report.html").read_text(errors="replace")
    for text in ("e2e.pdf", "ablation.pdf", "multinode.pdf", "table4.md", "claims.md",
                 "e2e.csv", "Figure 7: end-to-end training throughput",
                 "Figure 8: multi-node throughput", "Figure 9: ablation",
                 "Table 4: lines of schedule code", "Claims C1-C4"):
        assert text in html, text


def test_cases_run_in_the_planned_order_the_compared_ones_together(_completed):
    config = yaml.safe_load((_completed / "configs" / "config.yaml").read_text())
    priority = plan.run_order(plan.load_cases(plan.resolve(config), _completed))
    trace = [json.loads(line) for line in (_completed / "fake_trace.jsonl").read_text()
             .splitlines() if line]
    ran = []  # each case's first run (the recheck and gaps run some again afterwards)
    for job in sorted(trace, key=lambda j: j["start"]):
        for exp in ("e2e", "ablation"):
            if (exp, job["case_id"]) in priority and (exp, job["case_id"]) not in ran:
                ran.append((exp, job["case_id"]))
    assert ran == sorted(priority, key=priority.get, reverse=True)  # the planned order
    assert [cid.split("__")[0] for _, cid in ran[:4]] == [
        "megatron", "slapo-megatron", "deepspeed", "slapo-deepspeed"]  # bert-tiny, 1 rank
