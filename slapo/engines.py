"""Runtime engines that ``slapo.build(sch, target=...)`` hands the scheduled model to.

The one import of a training framework in the schedule language, made only when the target is
asked for (the import-linter contract allows this module alone to import DeepSpeed).
"""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path

from torch import nn

from . import state


def _outermost(names: list[str]) -> list[str]:
    """``names`` (qualified module names) without those inside another of them, in order."""
    if "" in names:
        return [""]
    return [name for name in names
            if not any(name.startswith(f"{outer}.") for outer in names if outer != name)]


def compiled_regions(model: nn.Module) -> list[str]:
    """The qualified names of the outermost compiled regions in ``model``: modules whose
    forward ``compile`` compiled, and ``fuse``'s modules with a compiler."""
    from .primitives.fuse import TORCHSCRIPT, FusedModule

    return _outermost([name for name, mod in model.named_modules()
                       if state.is_compiled(mod) or (isinstance(mod, FusedModule) and
                                                     mod.compiler not in (None, TORCHSCRIPT))])


def layer_regions(model: nn.Module) -> list[str]:
    """The qualified names of the outermost modules of ``model`` that transformers keeps whole
    (a model's ``_no_split_modules``: its transformer layers, some models' embeddings)."""
    kinds = set(getattr(model, "_no_split_modules", None) or ())
    # by the class or a base: checkpoint makes a layer's class a subclass of its own
    return _outermost([name for name, mod in model.named_modules()
                       if any(cls.__name__ in kinds for cls in type(mod).__mro__)])


def zero3_leaf_refusal(model: nn.Module, name: str) -> str | None:
    """Why the region ``name`` of ``model`` cannot be a ZeRO-3 leaf module, or None."""
    region = model.get_submodule(name)
    if any(isinstance(mod, nn.Embedding) for mod in region.modules()):
        # measured with DeepSpeed 0.19.8, compiled or not: a size-0 parameter in the backward
        return ("it holds an embedding, whose token-id inputs need no gradient, and ZeRO-3 "
                "does not gather such a leaf's parameters again for its backward")
    shared = max(state.calls_per_forward(mod) for mod in region.modules())
    if shared > 1:
        # measured with DeepSpeed 0.19.8: an assertion on the repeated parameters' gradients
        return (f"it runs {shared} times a forward (its weights are shared), and ZeRO-3 "
                "reduces a leaf's gradients when each call's backward ends")
    inside = {id(p) for p in region.parameters()}
    for other, mod in model.named_modules():
        if other != name and not other.startswith(f"{name}.") and \
                any(id(p) in inside for p in mod.parameters(recurse=False)):
            return (f"it shares a parameter with '{other}' (tied weights), whose gradient "
                    "ZeRO-3 would reduce when the leaf's backward ends, before the rest arrives")
    return None


def zero3_leaves(model: nn.Module, layers: bool = False) -> tuple[list[str], dict[str, str]]:
    """The compiled regions of ``model`` (and with ``layers`` its :func:`layer_regions`) that
    become ZeRO-3 leaf modules, and the others with the reason (:func:`zero3_leaf_refusal`);
    see :func:`with_zero3_leaves`."""
    leaves, refused = [], {}
    regions = compiled_regions(model) + (layer_regions(model) if layers else [])
    for name in _outermost(list(dict.fromkeys(regions))):
        why = zero3_leaf_refusal(model, name)
        if why is None:
            leaves.append(name)
        else:
            refused[name] = why
    return leaves, refused


def with_zero3_leaves(model: nn.Module, config: dict, layers: bool = False) -> dict:
    """``config`` with the compiled regions of ``model`` named ZeRO-3 leaf modules, and with
    ``layers`` its transformer layers (:func:`layer_regions`), when the config asks for ZeRO
    stage 3 (else ``config`` as it is).

    ZeRO-3 gathers a module's parameters in hooks on that module. Inside a compiled region
    Dynamo would trace those hooks or break the graph at them, and recompile per layer class.
    A leaf module (DeepSpeed's ``zero_optimization.leaf_module``) has no hooks below it: its
    own hooks, which run eagerly around the compiled forward, gather all of its parameters
    before it and release them after, and its gradients are reduced once its backward is done.
    A region that cannot be a leaf (:func:`zero3_leaf_refusal`: an embedding, tied weights)
    keeps ZeRO-3's hooks on its modules, and Dynamo breaks its graph at them.

    An uncompiled layer as a leaf trains the same, with one gather and one release for the
    layer instead of one for each of its modules, and their hooks (ZeRO-3's steps of bert-tiny
    and llama-tiny on one CPU rank took 1.2x to 1.4x less time).
    """
    zero = config.get("zero_optimization") or {}
    names, _ = zero3_leaves(model, layers)
    if zero.get("stage") != 3 or not names:
        return config
    config = copy.deepcopy(config)
    leaf = config["zero_optimization"].setdefault("leaf_module", {})
    leaf["names"] = list(dict.fromkeys([*leaf.get("names", []), *names]))
    return config


def with_torch_linear(model: nn.Module, config: dict) -> dict:
    """``config`` with DeepSpeed's memory-efficient linear off when ``model`` has compiled
    regions and the config asks for ZeRO stage 3 (else ``config`` as it is).

    Under ZeRO-3 DeepSpeed replaces ``torch.nn.functional.linear``, for the whole process,
    with its own autograd Function (``zero_optimization.memory_efficient_linear``, on by
    default). Dynamo of torch 2.11 traces that Function into a compiled region so that the
    region's Linear layers with a bias get no gradient at all, weight or bias (zeros from the
    first step; those without a bias train right; DeepSpeed 0.19.8, CPU; torch 2.13 traces it
    right). DeepSpeed's own compiler puts torch's linear back too
    (``deepspeed/compile/init_z3.py``). A config that turns it on itself is kept, with a
    warning."""
    zero = config.get("zero_optimization") or {}
    if zero.get("stage") != 3 or not compiled_regions(model):
        return config
    if zero.get("memory_efficient_linear") is True:
        warnings.warn("zero_optimization.memory_efficient_linear is on with compiled regions: "
                      "with torch 2.11 their biased Linear layers got no gradients under it",
                      stacklevel=3)
        return config
    config = copy.deepcopy(config)
    config["zero_optimization"]["memory_efficient_linear"] = False
    return config


def config_dict(config) -> dict:
    """DeepSpeed's configuration as a dict: given as one, or the path of a JSON file."""
    return config if isinstance(config, dict) else json.loads(Path(config).read_text())


def deepspeed_engine(model: nn.Module, config=None, optimizer=None,
                     zero3_layer_leaves: bool = False, topology=None, loss_fn=None,
                     **kwargs) -> tuple:
    """``deepspeed.initialize`` on ``model`` with ``config`` (a dict or a JSON path; required)
    and ``optimizer`` (a ``torch.optim.Optimizer``, or None to let the config name one);
    other keyword arguments go to ``deepspeed.initialize``. Returns ``(engine, optimizer)``:
    the engine is called and stepped as DeepSpeed's (``engine(**batch)``,
    ``engine.backward(loss)``, ``engine.step()``). Under ZeRO-3 the schedule's compiled
    regions become leaf modules, and with ``zero3_layer_leaves`` the transformer layers too
    (:func:`with_zero3_leaves`), and they run torch's own linear (:func:`with_torch_linear`).

    ``topology`` (upstream's): DeepSpeed's ``ProcessTopology`` of the ranks (its
    ``PipeModelDataParallelTopology(num_pp=1, num_mp=, num_dp=)``), given to DeepSpeed as
    its ``mpu`` (a ``PipelineParallelGrid``), so that ZeRO partitions over the data-parallel
    ranks only. A schedule with pipeline cuts does not come here (``build`` gives it to
    ``slapo.pipeline.deepspeed_pipe``); without cuts, a topology with pipeline stages and a
    ``loss_fn`` (here the engine returns the model's output) are refused."""
    if topology is not None:
        if topology.get_dim("pipe") > 1:
            raise ValueError(f"build(target='deepspeed'): the topology has "
                             f"{topology.get_dim('pipe')} pipeline stages, but the schedule "
                             "has no pipeline cuts: trace it and cut_pipeline_stage() where "
                             "each stage ends (DeepSpeed's pipeline engine then runs them)")
        import deepspeed
        from deepspeed.runtime.pipe.topology import PipelineParallelGrid

        deepspeed.init_distributed()  # the grid makes its groups through deepspeed.comm
        kwargs["mpu"] = PipelineParallelGrid(topology=topology)
    if loss_fn is not None:
        raise ValueError("build(target='deepspeed'): loss_fn is for pipeline stages (a "
                         "schedule with cuts); without them the engine returns the model's "
                         "output, whose loss the training loop computes")
    if config is None:
        raise ValueError("build(target='deepspeed') needs config=, DeepSpeed's configuration "
                         "(a dict or the path of a JSON file)")
    import deepspeed

    config = with_torch_linear(model, with_zero3_leaves(model, config_dict(config),
                                                        layers=zero3_layer_leaves))

    params = [p for p in model.parameters() if p.requires_grad] if optimizer is None else None
    engine, optimizer, _, _ = deepspeed.initialize(model=model, config=config,
                                                   optimizer=optimizer,
                                                   model_parameters=params, **kwargs)
    return engine, optimizer
