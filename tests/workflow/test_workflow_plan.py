"""The workflow's plan: profile choice, cases, and the files a case depends on."""
import json
import os
from pathlib import Path

import plan
import pytest
import yaml

from slapo_ae import gpus, sources
from slapo_ae.cfg import parse_cfg

REPO = Path(__file__).resolve().parents[2]
CONFIG = yaml.safe_load((REPO / "configs" / "config.yaml").read_text())


@pytest.mark.parametrize("env, count", [
    ({"CUDA_VISIBLE_DEVICES": ""}, 0),
    ({"CUDA_VISIBLE_DEVICES": "-1"}, 0),
    ({"CUDA_VISIBLE_DEVICES": "3"}, 1),
    ({"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}, 8),
    ({"CUDA_VISIBLE_DEVICES": "0,-1,1"}, 1),
])
def test_visible_gpus_honour_cuda_visible_devices(env, count):
    assert gpus.visible_gpus(env) == count
    settings = plan.resolve({**CONFIG, "gpus": "auto", "profile": "cpu"}, env)
    assert settings["gpus_available"] == count  # the planner detects them this one way


def test_visible_gpus_without_nvidia_smi(monkeypatch):
    monkeypatch.setattr(gpus.shutil, "which", lambda name: None)
    assert gpus.visible_gpus({}) == 0
    assert gpus.describe("cuda", 2)["device_name"] == "cuda (unknown)"


@pytest.mark.parametrize("gpus, profile", [(0, "cpu"), (1, "gpu1"), (4, "gpu1"), (8, "paper"),
                                           (16, "paper")])
def test_auto_profile(gpus, profile):
    assert plan.auto_profile(gpus) == profile
    settings = plan.resolve({**CONFIG, "gpus": gpus})
    assert settings["name"] == profile and settings["gpus_available"] == gpus


def test_resolve_explicit_and_unknown_profile():
    assert plan.resolve({**CONFIG, "profile": "paper", "gpus": 0})["name"] == "paper"
    with pytest.raises(plan.PlanError, match="'nope' is not defined"):
        plan.resolve({**CONFIG, "profile": "nope", "gpus": 0})


def test_a_cpu_profile_in_16_bits_is_refused_before_any_case():
    profiles = {name: dict(p) for name, p in CONFIG["profiles"].items()}
    profiles["cpu"]["dtype"] = "bf16"
    with pytest.raises(plan.PlanError, match="profile cpu: dtype bf16 on device cpu: CPU cases "
                                             "train in fp32 only"):
        plan.resolve({**CONFIG, "profiles": profiles, "profile": "cpu", "gpus": 0})


def test_a_key_given_twice_in_a_yaml_file_is_an_error_naming_its_line(tmp_path):
    # PyYAML keeps the last: a profile written twice ran only its second form
    config = tmp_path / "config.yaml"
    config.write_text("profiles:\n  mine:\n    steps: 4\n  mine:\n    steps: 400\n")
    with pytest.raises(plan.PlanError, match=rf"^{config}:4:3: not valid YAML: the key 'mine' "
                                             "is given twice in one mapping"):
        plan.check_yaml(config)
    plan.check_yaml(REPO / "configs" / "config.yaml")  # the shipped one has none


def test_paper_profile_is_exactly_figure7_and_figure9():
    cases = plan.load_cases(plan.resolve({**CONFIG, "profile": "paper", "gpus": 8}), REPO)
    e2e = parse_cfg(REPO / "configs/e2e/single_node_asplos24.cfg", max_gpus=8)
    ablation = parse_cfg(REPO / "configs/ablation/bert_1b_asplos24.cfg", max_gpus=8)
    assert list(cases["e2e"]) == [c.id for c in e2e] and len(e2e) == 72
    assert list(cases["ablation"]) == [c.id for c in ablation] and len(ablation) == 4
    settings = CONFIG["profiles"]["paper"]
    assert (settings["dtype"], settings["steps"]) == ("fp16", 40)


def test_cpu_profile_covers_tiny_models_on_one_and_two_ranks():
    cases = plan.load_cases(plan.resolve({**CONFIG, "profile": "cpu", "gpus": 0}), REPO)
    e2e = cases["e2e"].values()
    assert {c.model for c in e2e} == {"bert-tiny", "roberta-tiny", "gpt-neo-tiny", "opt-tiny",
                                      "t5-tiny", "wideresnet-tiny"}
    assert {c.gpus for c in e2e} == {1, 2}
    assert {c.mode for c in e2e} == {"megatron", "deepspeed", "slapo-megatron",
                                     "slapo-deepspeed"}
    assert [c.mode for c in cases["ablation"].values()] == [
        "eager", "slapo-kernel", "slapo-tp-attn-ffn", "slapo-tp-full"]


def test_gpu1_profile_fits_one_gpu():
    cases = plan.load_cases(plan.resolve({**CONFIG, "profile": "gpu1", "gpus": 1}), REPO)
    assert {c.gpus for exp in cases.values() for c in exp.values()} == {1}
    assert {c.model for c in cases["e2e"].values()} == {
        "bert-large-uncased", "EleutherAI/gpt-neo-1.3B", "facebook/opt-1.3b", "llama-1.1b"}


def test_cfg_errors_name_file_and_line(tmp_path):
    (tmp_path / "configs" / "models").mkdir(parents=True)
    (tmp_path / "configs" / "models" / "bert-tiny.json").write_text("{}")
    (tmp_path / "a.cfg").write_text("# a\neager bert-tiny 1 64 0 2 0\n")
    (tmp_path / "b.cfg").write_text("eager bert-tiny 1 64 0 2 0\n")
    (tmp_path / "c.cfg").write_text("eager bert-tiny 1 64 0 2 0\nbogus bert-tiny 1 64 0 2 0\n")
    settings = {"name": "t", "max_gpus": 2,
                "experiments": {"e2e": ["a.cfg", "b.cfg"], "ablation": ["c.cfg", "d.cfg"]}}
    with pytest.raises(plan.PlanError) as err:
        plan.load_cases(settings, tmp_path)
    text = str(err.value)
    assert "b.cfg:1: duplicate case eager__bert-tiny__g1__s64__b2__c0 (also at" in text
    assert "c.cfg:2: unknown mode 'bogus'" in text
    assert "d.cfg: no such cfg file" in text


def test_job_case_has_fields_not_cfg_location():
    case = parse_cfg(REPO / "configs/e2e/cpu_tiny.cfg", max_gpus=2)[0]
    job = plan.job_case(case, CONFIG["profiles"]["cpu"])
    assert job.id == case.id
    spec = json.loads(job.to_json())
    assert "line" not in spec and "source" not in spec
    assert {"steps", "warmup", "dtype", "device"} <= set(spec)
    assert "timeout" not in spec  # a resource: raising it reruns nothing
    assert plan.runtime_minutes({"timeout": 600}) == 12


def test_export_slots(monkeypatch):
    monkeypatch.delenv(plan.SLOTS_DIR_ENV, raising=False)
    config = {"gpu_slots": True, "gpu_slots_dir": "/tmp/x"}
    plan.export_slots(config, {"device": "cuda", "gpus_available": 8})
    assert os.environ[plan.SLOTS_DIR_ENV] == "/tmp/x"
    assert os.environ[plan.SLOTS_TOTAL_ENV] == "8"
    plan.export_slots({**config, "gpu_slots": False}, {"device": "cuda", "gpus_available": 8})
    assert plan.SLOTS_DIR_ENV not in os.environ
    plan.export_slots(config, {"device": "cpu", "gpus_available": 0})
    assert plan.SLOTS_TOTAL_ENV not in os.environ


def test_case_sources_follow_mode_and_family():
    cases = {c.id: c for c in parse_cfg(REPO / "configs/e2e/cpu_tiny.cfg", max_gpus=2)}
    code = sources.case_code(REPO)
    assert "slapo_ae/record.py" in code and "slapo_ae/harness/runner.py" in code
    assert "slapo/schedule.py" in code
    assert not any(f.startswith("slapo_ae/analysis/") for f in code)
    assert "slapo_ae/sources.py" not in code
    assert not any(f.startswith("slapo/model_schedule/") for f in code)

    slapo_bert = sources.case_sources(cases["slapo-megatron__bert-tiny__g2__s128__b8__c0"], REPO)
    baseline = sources.case_sources(cases["deepspeed__bert-tiny__g2__s128__b8__c0"], REPO)
    slapo_opt = sources.case_sources(cases["slapo-deepspeed__opt-tiny__g1__s128__b4__c0"], REPO)
    assert "slapo/model_schedule/bert.py" in slapo_bert
    assert "slapo/model_schedule/common.py" in slapo_bert
    assert "configs/models/bert-tiny.json" in slapo_bert
    assert not any(f.startswith("slapo/model_schedule/") for f in baseline)
    assert "slapo/model_schedule/bert.py" not in slapo_opt
    assert "slapo/model_schedule/opt.py" in slapo_opt
    # a schedule of a family outside the artifact's zoo (GPT-2) reruns nothing
    assert "slapo/model_schedule/gpt2.py" not in slapo_bert + slapo_opt
    assert set(sources.schedule_files(REPO)) == set(sources.FAMILIES)
    assert all((REPO / f).is_file() for f in slapo_bert + baseline + slapo_opt)


def test_resources_and_threads():
    case = parse_cfg(REPO / "configs/e2e/cpu_tiny.cfg", max_gpus=2)[1]
    assert case.gpus == 2
    assert plan.gpus_resource(case, {"device": "cuda"}) == 2
    assert plan.gpus_resource(case, {"device": "cpu"}) == 0
    # more GPUs than the machine has: the job runs (its runner records it unsupported) where
    # Snakemake would stop the run; Slurm's request stays the case's own
    one_gpu = {"device": "cuda", "gpus_available": 1, "max_gpus": 8}
    assert plan.gpus_resource(case, one_gpu) == 1 and plan.gpu_request(case, one_gpu) == 2
    assert plan.machine_job_gpus(one_gpu) == (1, 8)
    assert plan.machine_job_gpus({"device": "cuda", "gpus_available": 0, "max_gpus": 8}) == (8, 8)
    assert plan.machine_job_gpus({"device": "cpu", "max_gpus": 2}) == (0, 0)
    # CPU: the job holds every core (cases run alone), its ranks one core each
    one_rank = parse_cfg(REPO / "configs/e2e/cpu_tiny.cfg", max_gpus=2)[0]
    assert one_rank.gpus == 1
    for cores in (2, 16):
        assert plan.threads(case, {"device": "cpu"}, cores) == cores
        assert plan.threads(one_rank, {"device": "cpu"}, cores) == cores
        assert plan.rank_cores(case, {"device": "cpu"}, cores) == 2
        assert plan.rank_cores(one_rank, {"device": "cpu"}, cores) == 1
    # CUDA: the share of the cores that the case's GPUs are of the machine's, at least one
    assert plan.threads(case, {"device": "cuda", "gpus_available": 8}, 16) == 4
    assert plan.threads(case, {"device": "cuda", "gpus_available": 8}, 2) == 1
    assert plan.threads(case, {"device": "cuda", "gpus_available": 2}, 16) == 16
    assert plan.rank_cores(case, {"device": "cuda", "gpus_available": 8}, 16) == 4


# -- cases on several nodes -------------------------------------------------------------
def _tiny_case(**fields):
    from slapo_ae.case import Case

    base = dict(mode="deepspeed", model="bert-tiny", gpus=16, seq_len=64, dec_seq_len=0,
                batch_size=16, batch_expr="16", ckpt=0.0)
    return Case(**{**base, **fields})


def test_existing_profiles_keep_every_case_on_one_node():
    for name, count in (("cpu", 0), ("gpu1", 1), ("paper", 8)):
        settings = plan.resolve({**CONFIG, "profile": name, "gpus": count})
        assert settings["gpus_per_node"] is None
        cases = plan.load_cases(settings, REPO)
        assert all(c.nodes == 1 and "__n" not in c.id for exp in cases.values()
                   for c in exp.values())
        assert cases["multinode"] == {}


def test_multinode_profile_is_figure8_on_nodes_of_eight():
    settings = plan.resolve({**CONFIG, "profile": "multinode", "gpus": 8})
    # bf16: the pipelined systems record fp16 as unsupported (no loss scaling in the schedule)
    assert (settings["device"], settings["dtype"], settings["steps"]) == ("cuda", "bf16", 40)
    cases = plan.load_cases(settings, REPO)
    assert cases["e2e"] == {} and cases["ablation"] == {}
    found = list(cases["multinode"].values())
    assert len(found) == 2 * 3 * 3
    assert {c.model for c in found} == {"gpt-neo-10B", "llama-7b"}
    assert {c.mode for c in found} == {"megatron", "deepspeed", "slapo-megatron"}
    assert {(c.gpus, c.nodes) for c in found} == {(16, 2), (32, 4), (64, 8)}
    assert {c.gpus_per_node for c in found} == {8}
    assert {(c.seq_len, c.batch_size) for c in found} == {(1024, 256)}
    assert all(f"__g{c.gpus}__n{c.nodes}__" in c.id for c in found)
    pipelined = [c for c in found if c.mode != "deepspeed"]
    assert {(c.pp, c.tp_size, c.micro_batch_size) for c in pipelined} == {(2, 8, 4)}
    assert "megatron__llama-7b__g16__n2__p2__t8__m4__s1024__b256__c0" in cases["multinode"]


def test_cpu_multinode_profile_is_two_nodes_of_two_ranks():
    settings = plan.resolve({**CONFIG, "profile": "cpu-multinode", "gpus": 0})
    assert settings["device"] == "cpu" and settings["steps"] - settings["warmup"] >= 5
    found = list(plan.load_cases(settings, REPO)["multinode"].values())
    assert {c.model for c in found} == {"gpt-neo-tiny", "llama-tiny"}
    assert {c.mode for c in found} == {"megatron", "deepspeed", "slapo-megatron"}
    assert {(c.gpus, c.nodes, c.gpus_per_node) for c in found} == {(4, 2, 2)}
    assert {(c.pp, c.tp_size, c.dp_size, c.micro_batch_size) for c in found
            if c.mode != "deepspeed"} == {(2, 2, 1, 2)}


def test_nodes_come_from_the_profiles_gpus_per_node(tmp_path):
    settings = {"name": "t", "gpus_per_node": 8}
    assert plan.spread_over_nodes(_tiny_case(gpus=4), settings).nodes == 1
    assert plan.spread_over_nodes(_tiny_case(gpus=8), settings).nodes == 1
    two = plan.spread_over_nodes(_tiny_case(), settings)
    assert (two.nodes, two.gpus_per_node) == (2, 8) and "__g16__n2__" in two.id
    assert plan.spread_over_nodes(_tiny_case(), {"name": "t", "gpus_per_node": None}).nodes == 1
    # a count that does not fill whole nodes: the cfg file and line
    (tmp_path / "m.cfg").write_text("# m\ndeepspeed bert-tiny 12 64 0 12 0\n")
    with pytest.raises(plan.PlanError, match=r"^m.cfg:2: 12 GPUs do not fill whole nodes of 8 "
                                             r"\(gpus_per_node of profile t\)$"):
        plan.load_cases({"name": "t", "max_gpus": 16, "gpus_per_node": 8,
                         "experiments": {"multinode": ["m.cfg"]}}, tmp_path)


def test_a_case_on_nodes_holds_one_nodes_share_and_asks_for_its_nodes():
    cuda = {"device": "cuda", "gpus_available": 8}
    two = _tiny_case(nodes=2)
    # each node's agent: the share of a node's cores its GPUs there are (all 8 of 8)
    assert plan.threads(two, cuda, 64) == 64 and plan.rank_cores(two, cuda, 64) == 64
    assert plan.rank_cores(_tiny_case(gpus=4, nodes=2), {"device": "cpu"}, 2) == 2
    # one node: no node resources at all, the GPU request as before
    assert set(plan.node_resources(_tiny_case(gpus=8), cuda, {}, 64).values()) == {None}
    assert plan.gpu_request(_tiny_case(gpus=8), cuda) == 8
    assert plan.gpu_request(two, cuda) is None  # asked per machine (gres) instead
    local = plan.node_resources(two, cuda, {"nodes_via": "local"}, 64)
    assert {k: v for k, v in local.items() if v is not None} == {"nodes": 2}
    srun = plan.node_resources(two, cuda, {"nodes_via": "srun"}, 64)
    assert srun == {"nodes": 2, "tasks": 2, "mpi": "srun", "tasks_per_gpu": 0,
                    "cpus_per_task": 64, "gres": "gpu:8"}
    # a cluster of one machine (max_job_nodes 1): both agents as tasks on it, half its cores
    cpu = plan.node_resources(_tiny_case(gpus=4, nodes=2), {"device": "cpu"},
                              {"nodes_via": "srun", "max_job_nodes": 1}, 2)
    assert {k: v for k, v in cpu.items() if v is not None} == {
        "nodes": 1, "tasks": 2, "mpi": "srun", "cpus_per_task": 1}


def test_export_nodes_via(monkeypatch):
    monkeypatch.setenv(plan.NODES_VIA_ENV, "before")  # restored after the test
    plan.export_nodes_via({})
    assert os.environ[plan.NODES_VIA_ENV] == "local"
    plan.export_nodes_via({"nodes_via": "srun"})
    assert os.environ[plan.NODES_VIA_ENV] == "srun"


def test_a_case_on_several_nodes_depends_on_the_srun_script():
    files = sources.case_sources(_tiny_case(nodes=2), REPO)
    assert sources.SRUN_CASE in files and (REPO / sources.SRUN_CASE).is_file()
    assert sources.SRUN_CASE not in sources.case_sources(_tiny_case(gpus=8), REPO)


def test_profiles_list_their_tunings_and_a_tuned_case_takes_its_cells_place():
    paper = plan.resolve({**CONFIG, "profile": "paper", "gpus": 8})
    (spec,) = plan.load_tunings(paper, REPO).values()
    assert spec.path == "configs/autotune/wideresnet_2.4B_g4.yaml"
    trials = plan.tuning_cases({spec.name: spec})[f"autotune/{spec.name}"]
    assert len(trials) == 91
    e2e = plan.load_cases(paper, REPO)["e2e"]
    tuned = spec.case_for({"batch_size": 136, "ckpt_ratio": 0.67})
    fed_back = plan.tuned_e2e(e2e, [tuned])
    assert "slapo-deepspeed__wideresnet-2.4B__g4__s1__b144__c0.5" in e2e
    assert "slapo-deepspeed__wideresnet-2.4B__g4__s1__b144__c0.5" not in fed_back
    assert tuned.id in fed_back and len(fed_back) == len(e2e)
    # in its cell's place: it runs beside the other systems of its point (run_order)
    at = list(e2e).index("slapo-deepspeed__wideresnet-2.4B__g4__s1__b144__c0.5")
    assert list(fed_back)[at] == tuned.id
    order = plan.run_order({"e2e": fed_back})
    assert order["e2e", tuned.id] == plan.run_order({"e2e": e2e})["e2e", list(e2e)[at]]
    cpu = plan.resolve({**CONFIG, "profile": "cpu", "gpus": 0})
    (small,) = plan.load_tunings(cpu, REPO).values()
    trial = next(iter(small.cases().values()))[1]
    job = plan.job_case(trial, cpu, small)
    assert (job.steps, job.warmup) == (small.steps, small.warmup) and job.memory_per_rank
    assert plan.tuned_e2e({}, [trial])[trial.id].memory_per_rank is None  # Figure 7: no cap
    assert plan.load_tunings(plan.resolve({**CONFIG, "profile": "gpu1", "gpus": 1}), REPO) == {}


def test_a_bad_tuning_spec_is_a_plan_error_naming_it(tmp_path):
    (tmp_path / "t.yaml").write_text("case: 'eager bert-tiny 1 16 0 b 0'\nsymbols: {b: 3}\n")
    settings = {"name": "x", "experiments": {"autotune": ["t.yaml", "missing.yaml"]}}
    with pytest.raises(plan.PlanError) as err:
        plan.load_tunings(settings, tmp_path)
    lines = str(err.value).splitlines()
    assert lines[0].startswith("t.yaml:2: symbols.b: give")
    assert lines[1] == "missing.yaml: no such tuning spec (profile x, autotune)"


def test_files_of_the_plan_that_are_not_text_are_plan_errors_naming_the_byte(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_bytes(b"profile: cpu\n\x89PNG\r\n")
    with pytest.raises(plan.PlanError, match=rf"^{config}: not UTF-8 text: byte 0x89 at offset "
                                             "13 cannot be decoded"):
        plan.check_yaml(config)
    (tmp_path / "a.cfg").write_bytes(b"\xff\xfe")
    (tmp_path / "t.yaml").write_bytes(b"case: \xe9")
    settings = {"name": "x", "max_gpus": 2, "experiments": {"e2e": ["a.cfg"],
                                                            "autotune": ["t.yaml"]}}
    with pytest.raises(plan.PlanError, match=r"^a\.cfg: not UTF-8 text: byte 0xff at offset 0 "):
        plan.load_cases(settings, tmp_path)
    with pytest.raises(plan.PlanError, match=r"^t\.yaml: not UTF-8 text: byte 0xe9 at offset 6 "):
        plan.load_tunings(settings, tmp_path)


def test_steps_past_what_the_harness_runs_are_refused_at_start():
    """A profile's (or the smoke case's) steps past slapo-bench run's bound stop the workflow
    in one line, rather than every case failing in its job."""
    from slapo_ae.case import MAX_STEPS

    schema = REPO / "workflow" / "schemas" / "config.schema.yaml"
    config = json.loads(json.dumps(CONFIG))
    config["profiles"]["cpu"]["steps"] = MAX_STEPS + 1
    with pytest.raises(plan.PlanError, match=f"profiles.cpu.steps: {MAX_STEPS + 1} is greater "
                                             f"than the maximum of {MAX_STEPS}"):
        plan.check_config(config, schema)
    config["profiles"]["cpu"]["steps"] = MAX_STEPS
    config["kick_the_tires"]["steps"] = MAX_STEPS + 1
    with pytest.raises(plan.PlanError, match="kick_the_tires.steps: "):
        plan.check_config(config, schema)


def test_run_order_puts_the_systems_of_a_point_together_alternating():
    cases = plan.load_cases(plan.resolve({**CONFIG, "profile": "cpu", "gpus": 0}), REPO)
    priority = plan.run_order(cases)
    assert set(priority) == {(exp, cid) for exp in cases for cid in cases[exp]}
    assert sorted(priority.values()) == list(range(1, len(priority) + 1))  # a total order
    ordered = sorted(priority, key=priority.get, reverse=True)
    e2e = [cases[exp][cid] for exp, cid in ordered if exp == "e2e"]
    assert [exp for exp, _ in ordered[:len(e2e)]] == ["e2e"] * len(e2e)
    points = [e2e[i:i + 4] for i in range(0, len(e2e), 4)]
    for i, point in enumerate(points):  # each point's four systems one after another ...
        assert len({(c.model, c.gpus) for c in point}) == 1
        modes = [c.mode for c in point]
        systems = ["megatron", "slapo-megatron", "deepspeed", "slapo-deepspeed"]
        assert modes == (systems if i % 2 == 0 else systems[::-1])  # ... first, then last
    ablation = [cases[exp][cid].mode for exp, cid in ordered if exp == "ablation"]
    assert ablation == ["eager", "slapo-kernel", "slapo-tp-attn-ffn", "slapo-tp-full"]


def test_gpu_smoke_profile_runs_figure7_and_figure9_on_one_gpu():
    profile = plan.resolve({**CONFIG, "profile": "gpu-smoke", "gpus": 1})
    assert profile["device"] == "cuda" and profile["steps"] == 8 and profile["warmup"] == 4
    cases = plan.load_cases(profile, REPO)
    assert {c.mode for c in cases["e2e"].values()} == {"megatron", "slapo-megatron", "deepspeed",
                                                        "slapo-deepspeed"}
    assert {c.mode for c in cases["ablation"].values()} == {"eager", "slapo-kernel"}
    assert {c.gpus for exp in cases.values() for c in exp.values()} == {1}
