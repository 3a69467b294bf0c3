"""The cfg files shipped in configs/ parse and match the paper's tables (docs/paper.md)."""
from pathlib import Path

import pytest

from slapo_ae.cfg import parse_cfg

ROOT = Path(__file__).resolve().parents[2]
FIG7 = ROOT / "configs" / "e2e" / "single_node_asplos24.cfg"
FIG9 = ROOT / "configs" / "ablation" / "bert_1b_asplos24.cfg"

# Figure 7: global batch for 2/4/8 GPUs, checkpointing in parentheses when not 0;
# None: "-" in the paper (Megatron-LM has no such model).
N, F = None, "full"
FIGURE7 = {
    "bert-xlarge": {
        "megatron": [(20, N), (40, N), (56, N)],
        "slapo-megatron": [(56, 0), (80, 0), (96, 0)],
        "deepspeed": [(36, 0), (72, 0), (144, 0)],
        "slapo-deepspeed": [(48, 0), (96, 0), (200, 0)],
    },
    "roberta-xlarge": {
        "megatron": None,
        "slapo-megatron": [(26, 0), (52, 0), (56, 0)],
        "deepspeed": [(24, 0), (52, 0), (112, 0)],
        "slapo-deepspeed": [(36, 0), (60, 0), (160, 0)],
    },
    "gpt-neo-2.9B": {
        "megatron": [(6, F), (4, N), (12, N)],
        "slapo-megatron": [(7, 1), (7, 0), (13, 0)],
        "deepspeed": [(6, 1), (28, 1), (48, 1)],
        "slapo-deepspeed": [(6, 1), (28, 0.6), (64, 0.6)],
    },
    "facebook/opt-2.7b": {
        "megatron": None,
        "slapo-megatron": [(4, 0), (8, 0), (16, 0)],
        "deepspeed": [(4, 1), (8, 1), (16, 1)],
        "slapo-deepspeed": [(6, 0.67), (12, 0.34), (24, 0.25)],
    },
    "t5-3b": {
        "megatron": [(4, F), (6, N), (12, N)],
        "slapo-megatron": [(4, 1), (6, 0.25), (10, 0)],
        "deepspeed": [(2, 1), (8, 1), (16, 1)],
        "slapo-deepspeed": [(2, 1), (12, 0.92), (24, 0.67)],
    },
    "wideresnet-2.4B": {
        "megatron": None,
        "slapo-megatron": [(16, 0), (32, 0), (48, 0)],
        "deepspeed": [(32, 1), (128, 1), (256, 1)],
        "slapo-deepspeed": [(64, 0.34), (144, 0.5), (264, 0)],
    },
}
SEQ = {"bert-xlarge": (512, 0), "roberta-xlarge": (512, 0), "gpt-neo-2.9B": (1024, 0),
       "facebook/opt-2.7b": (1024, 0), "t5-3b": (1024, 512), "wideresnet-2.4B": (1, 0)}


def test_figure7_cfg_reproduces_the_table():
    cases = parse_cfg(FIG7)
    assert len(cases) == 6 * 4 * 3
    by_key = {(c.model, c.mode, c.gpus): c for c in cases}
    for model, systems in FIGURE7.items():
        for mode, cells in systems.items():
            for gpus, cell in zip((2, 4, 8), cells or [None] * 3):
                case = by_key[(model, mode, gpus)]  # "-" rows are present too
                assert (case.seq_len, case.dec_seq_len) == SEQ[model]
                if cell is not None:
                    assert (case.batch_size, case.ckpt) == cell, case.id


@pytest.mark.parametrize("path", [FIG7, FIG9])
def test_shipped_cfgs_parse(path):
    assert parse_cfg(path)


def test_figure9_cfg_is_the_ablation():
    steps = [(c.mode, c.model, c.gpus, c.seq_len, c.batch_size) for c in parse_cfg(FIG9)]
    assert steps == [
        ("eager", "bert-xlarge", 1, 512, 12),
        ("slapo-kernel", "bert-xlarge", 1, 512, 20),
        ("slapo-tp-attn-ffn", "bert-xlarge", 8, 512, 64),
        ("slapo-tp-full", "bert-xlarge", 8, 512, 96),
    ]


def test_figure8_cfg_is_the_multinode_setting():
    """LLaMA-7B as the paper ran it (global batch 256, micro-batch 4, seq 1024, pipeline 2 x
    tensor 8) and GPT-10B with the same setting, on 16, 32 and 64 GPUs."""
    cases = parse_cfg(ROOT / "configs" / "multinode" / "multinode_asplos24.cfg")
    assert len(cases) == 2 * 3 * 3
    assert {(c.model, c.mode, c.gpus) for c in cases} == {
        (model, mode, gpus) for model in ("gpt-neo-10B", "llama-7b")
        for mode in ("megatron", "deepspeed", "slapo-megatron") for gpus in (16, 32, 64)}
    for case in cases:
        assert (case.seq_len, case.dec_seq_len, case.batch_size) == (1024, 0, 256), case.id
        if case.mode == "deepspeed":  # ZeRO-3: every GPU a data-parallel rank
            assert (case.pp, case.tp_size, case.micro_batch_size) == (1, 1, 256 // case.gpus)
        else:
            assert (case.pp, case.tp_size, case.micro_batch_size) == (2, 8, 4), case.id
            assert case.dp_size == case.gpus // 16
