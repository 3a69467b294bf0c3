"""The workflow as Snakemake sees it: lint, config validation, the paper DAG, the report."""
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


def test_config_is_validated_at_start(repo):
    config = yaml.safe_load((repo.path / "configs" / "config.yaml").read_text())
    config["profiles"]["test"]["dtype"] = "fp8"
    repo.write_config(config)
    proc = repo.snakemake("-n", check=False)
    assert proc.returncode != 0
    assert "fp8" in proc.stdout + proc.stderr


def test_broken_yaml_is_named_by_file_and_line(repo):
    path = repo.path / "configs" / "config.yaml"
    path.write_text(path.read_text() + "profile: [cpu\nsteps: 3\n")
    lines = path.read_text().count("\n")
    proc = repo.snakemake("-n", check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert f"configs/config.yaml:{lines}:" in out and "not valid YAML" in out, out[-2000:]


def test_bad_cfg_line_stops_the_dag_with_file_and_line(repo):
    cfg = repo.path / "configs" / "e2e" / "test.cfg"
    cfg.write_text(cfg.read_text() + "slapo-megatorn bert-tiny 2 64 0 4 0\n")
    proc = repo.snakemake("-n", check=False)
    assert proc.returncode != 0
    assert "configs/e2e/test.cfg:8: unknown mode 'slapo-megatorn'" in proc.stdout + proc.stderr


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
            "gaps", "claims", "all"} <= set(jobs)


def test_report_has_figures_tables_and_captions(done_repo):
    done_repo.snakemake("--report", "report.html")
    html = (done_repo.path / "report.html").read_text(errors="replace")
    for text in ("e2e.pdf", "ablation.pdf", "table4.md", "claims.md", "e2e.csv",
                 "Figure 7: end-to-end training throughput", "Figure 9: ablation",
                 "Table 4: lines of schedule code", "Claims C1-C4"):
        assert text in html, text
