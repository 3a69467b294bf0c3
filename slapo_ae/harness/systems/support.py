"""Which cases each system can run, decided from the case alone: no torch, no engine import.

The harness's parent process calls :func:`check` before it launches anything (a case no
system can run is recorded ``unsupported`` at once), and every rank calls it again before
it builds the model. Keeping the rules here, apart from the system modules (which import
torch, DeepSpeed or megatron-core), saves the parent the seconds of importing torch for every
case.
"""
from __future__ import annotations

import importlib.util


class Unsupported(Exception):
    """This case cannot run under this system (the record's status becomes ``unsupported``)."""


# The model families megatron-core has a model for (systems/megatron.py builds them), and the
# paper's names of those it has not.
MEGATRON_FAMILIES = ("bert", "gpt_neo", "llama", "t5")
PAPER_NAMES = {"roberta": "RoBERTa", "opt": "OPT", "wideresnet": "WideResNet"}

# Families whose transformers 5.x classes have no SDPA attention, and why.
NO_HF_SDPA = {
    "gpt_neo": "transformers has no SDPA attention for GPT-Neo (eager or flash-attention only)",
    "wideresnet": "WideResNet has no attention (and is not a transformers model)",
}


def _family(spec) -> str:
    from slapo_ae.zoo import model_family

    return model_family(spec.case.model)


def _check_megatron(spec) -> None:
    family = _family(spec)
    if family not in MEGATRON_FAMILIES:
        name = PAPER_NAMES.get(family, family)
        raise Unsupported(f"Megatron-LM has no {name} model (the paper's Figure 7 marks it "
                          f"'-'); megatron-core models here: BERT, GPT (GPT-Neo, LLaMA), T5")
    if importlib.util.find_spec("megatron.core") is None:
        raise Unsupported("megatron-core is not installed")
    if spec.case.ckpt not in (None, "full", "selective"):
        raise Unsupported(f"megatron takes CKPT full, selective or 0, not {spec.case.ckpt!r}")


def _check_hf_sdpa(spec) -> None:
    reason = NO_HF_SDPA.get(_family(spec))
    if reason:
        raise Unsupported(reason)


def _check_torchscript(spec) -> None:
    raise Unsupported("torchscript mode is not implemented by this harness (the original "
                      "benchmark's TorchScript path does not apply to current PyTorch)")


MODE_CHECKS = {"megatron": _check_megatron, "hf-sdpa": _check_hf_sdpa,
               "torchscript": _check_torchscript}


def check(spec) -> None:
    """Raise :class:`Unsupported` if the system of ``spec.case.mode`` cannot run ``spec``:
    16-bit precision is a GPU setting here, then the mode's own rules."""
    if spec.case.device == "cpu" and spec.case.dtype != "fp32":
        raise Unsupported(f"{spec.case.dtype} on CPU: CPU runs train in fp32 only "
                          "(mixed precision is a GPU setting in this harness)")
    rule = MODE_CHECKS.get(spec.case.mode)
    if rule is not None:
        rule(spec)
