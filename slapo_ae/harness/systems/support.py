"""Which cases each system can run, decided from the case alone: no torch, no engine import.

The harness's parent process calls :func:`check` before it launches anything (a case no
system can run is recorded ``unsupported`` at once), and every rank calls it again before
it builds the model. Keeping the rules here, apart from the system modules (which import
torch, DeepSpeed or megatron-core), saves the parent the seconds of importing torch for every
case.
"""
from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
from pathlib import Path


class Unsupported(Exception):
    """This case cannot run under this system (the record's status becomes ``unsupported``)."""


# The model families megatron-core has a model for (systems/megatron.py builds them), and the
# paper's names of those it has not.
MEGATRON_FAMILIES = ("bert", "gpt_neo", "llama", "t5")
PAPER_NAMES = {"roberta": "RoBERTa", "opt": "OPT", "wideresnet": "WideResNet"}

# The families whose layers the 3D systems split into pipeline stages, and the config field
# that counts their layers (megatron_3d.py builds megatron-core's GPT for them, slapo_3d.py
# cuts the HF model's layers).
PIPELINE_LAYERS = {"llama": "num_hidden_layers", "gpt_neo": "num_layers"}

# Families whose transformers 5.x classes have no SDPA attention, and why.
NO_HF_SDPA = {
    "gpt_neo": "transformers has no SDPA attention for GPT-Neo (eager or flash-attention only)",
    "wideresnet": "WideResNet has no attention (and is not a transformers model)",
}


def _check_megatron(spec) -> None:
    family = _family_of(spec.case)
    if family not in MEGATRON_FAMILIES:
        name = PAPER_NAMES.get(family, family)
        raise Unsupported(f"Megatron-LM has no {name} model (the paper's Figure 7 marks it "
                          f"'-'); megatron-core models here: BERT, GPT (GPT-Neo, LLaMA), T5")
    if importlib.util.find_spec("megatron.core") is None:
        raise Unsupported("megatron-core is not installed")
    if spec.case.ckpt not in (None, "full", "selective"):
        raise Unsupported(f"megatron takes CKPT full, selective or 0, not {spec.case.ckpt!r}")


def _layers(case) -> int:
    from slapo_ae.zoo import load_config

    field = PIPELINE_LAYERS[_family_of(case)]
    return int(case.overrides.get(field, load_config(case.model).get(field, 0)))


def _family_of(case) -> str:
    from slapo_ae.zoo import model_family

    return model_family(case.model)


def _check_megatron_3d(spec) -> None:
    case = spec.case
    family = _family_of(case)
    if family not in PIPELINE_LAYERS:
        raise Unsupported(f"megatron with pipeline stages or replicas (pp={case.pp}, "
                          f"dp={case.dp_size}): this harness runs megatron-core's GPT "
                          f"pipeline (GPT-Neo, LLaMA), not {family}")
    if case.dtype == "fp16":
        raise Unsupported("fp16 with megatron's pipeline schedule: its loss scaling is "
                          "Megatron-LM's optimizer's, which this harness does not use "
                          "(use bf16)")
    layers = _layers(case)
    if layers % case.pp:
        raise Unsupported(f"megatron-core splits the layers evenly over the stages: "
                          f"{layers} layers for pp={case.pp}")


def _check_slapo_3d(spec) -> None:
    case = spec.case
    if case.pp == 1:
        return
    family = _family_of(case)
    if family not in PIPELINE_LAYERS:
        raise Unsupported(f"pipeline stages (pp={case.pp}) of a {family} model: the "
                          f"harness cuts the layers of {', '.join(PIPELINE_LAYERS)} models only")
    layers = _layers(case)
    if layers < case.pp:
        raise Unsupported(f"pp={case.pp} stages for {layers} layers: a stage needs a layer")
    if case.dtype == "fp16":
        raise Unsupported("fp16 with pipeline stages: the backward runs inside DeepSpeed's "
                          "pipeline engine, where the harness's GradScaler cannot scale the "
                          "loss (use bf16)")


def _check_hf_sdpa(spec) -> None:
    reason = NO_HF_SDPA.get(_family_of(spec.case))
    if reason:
        raise Unsupported(reason)


def _check_hf_liger(spec) -> None:
    if spec.case.device != "cuda":
        raise Unsupported("liger-kernel's kernels are Triton kernels for GPUs; they do not run "
                          "on CPU")
    if importlib.util.find_spec("liger_kernel") is None:
        raise Unsupported("liger-kernel is not installed (the project's 'gpu' extra: "
                          "pip install '.[gpu]')")
    # Read from liger-kernel's source here; the rank asks the imported table again
    # (systems/eager.py), which decides where the source could not be read.
    model_types = liger_model_types()
    family = _family_of(spec.case)
    if model_types is not None and family not in model_types:
        raise Unsupported(no_liger_kernels(family, model_types))


# liger-kernel's table of its patches, by transformers model type
LIGER_TABLE = ("transformers/monkey_patch.py", "MODEL_TYPE_TO_APPLY_LIGER_FN")


def liger_model_types() -> list[str] | None:
    """The model types liger-kernel has patches for: the keys of its table, read from its
    source without importing it (the import needs torch and Triton: a rank started to refuse
    a case so took 11-14 s of each one-GPU check part at 62ef84e). None where the table is
    not a dict with string keys in that file (the rank then asks the imported table)."""
    found = importlib.util.find_spec("liger_kernel")
    if found is None or not found.submodule_search_locations:
        return None
    file, name = LIGER_TABLE
    try:
        tree = ast.parse(Path(next(iter(found.submodule_search_locations)), file).read_text())
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None
    for node in tree.body:
        targets = (node.targets if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(node, ast.AnnAssign) else [])
        if not any(isinstance(t, ast.Name) and t.id == name for t in targets):
            continue
        if not isinstance(node.value, ast.Dict):
            return None
        keys = [key.value for key in node.value.keys
                if isinstance(key, ast.Constant) and isinstance(key.value, str)]
        return keys if len(keys) == len(node.value.keys) else None
    return None


def no_liger_kernels(model_type: str, model_types) -> str:
    """The reason an hf-liger case of ``model_type`` is unsupported."""
    return (f"liger-kernel {importlib.metadata.version('liger-kernel')} has no kernels for "
            f"{model_type} models (it patches: {', '.join(sorted(model_types))})")


def _check_torchscript(spec) -> None:
    raise Unsupported("torchscript mode is not implemented by this harness (the original "
                      "benchmark's TorchScript path does not apply to current PyTorch)")


MODE_CHECKS = {"megatron": _check_megatron, "hf-sdpa": _check_hf_sdpa,
               "hf-liger": _check_hf_liger, "torchscript": _check_torchscript}
# A case with pipeline stages or replicas (Case.is_3d) runs under its mode's 3D system
MODE_CHECKS_3D = {"megatron": (_check_megatron, _check_megatron_3d),
                  "slapo-megatron": (_check_slapo_3d,)}


def check(spec) -> None:
    """Raise :class:`Unsupported` if the system of ``spec.case.mode`` (its 3D system for a
    case with pipeline stages or replicas) cannot run ``spec``: 16-bit precision is a GPU
    setting here, then the mode's own rules."""
    if spec.case.device == "cpu" and spec.case.dtype != "fp32":
        raise Unsupported(f"{spec.case.dtype} on CPU: CPU runs train in fp32 only "
                          "(mixed precision is a GPU setting in this harness)")
    if spec.case.is_3d and spec.case.mode in MODE_CHECKS_3D:
        rules = MODE_CHECKS_3D[spec.case.mode]
    else:
        rules = (MODE_CHECKS[spec.case.mode],) if spec.case.mode in MODE_CHECKS else ()
    for rule in rules:
        rule(spec)
