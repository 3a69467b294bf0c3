"""Cutting a traced model into pipeline stages.

``cut_pipeline_stage`` records cuts as module paths on the schedule root. ``split_stages``
works on a copy of the root graph: a cut inside a nested GraphModule (``trace`` with
``flatten=False``) is reached by inlining the GraphModules on the way into the top graph
(a cut after a module so inlined, T5's encoder, is a cut after the last node of its graph);
then every node goes to the stage of the last cut before it. Stage k takes the values that
earlier stages produced and later ones use (stage 0: the model's inputs), in graph order, and
returns those that later stages use; the last stage returns the model's output. Parameters
and modules stay under their original names in each stage's module. Stages exchange tensors
only: other values that cross a cut (ints, sizes, devices, tuples, None, a transformers
ModelOutput) are rewritten into tensors or rebuilt where they are used (below, at
``CARRIED``). ``shared_parameters`` names
the parameters that several stages hold (tied weights).

``generate_pipeline_partition`` is upstream Slapo's form of the same split: the schedule root
becomes one module whose children ``submod_0`` ... are the stages, called in turn.
Running the stages is ``slapo.pipeline.runtime``'s concern.
"""

from __future__ import annotations

import copy
import operator
from dataclasses import is_dataclass
from typing import Any

import torch
import torch.fx as fx

from .. import state
from ..tracing import ITEMS, KIND, has_foreign_hooks


def record_cut(sch) -> None:
    """Remember a cut after ``sch``'s module (checked by the primitive)."""
    state.add_pipeline_cut(sch.root, sch.path)


def pipeline_cuts(sch) -> list[str]:
    return state.pipeline_cuts(sch.root)


# --- splitting -------------------------------------------------------------------------
def split_stages(sch, tied: bool = False) -> list[fx.GraphModule]:
    """The stage modules of the traced root ``sch`` split at its recorded cuts. Running them
    one after another (``out = stage(*out)``) computes what the model computes.

    A parameter used by several stages (tied weights: an LM head sharing the embedding) is
    an error, unless ``tied``: then each of those stages holds it under its own name
    (``shared_parameters`` lists them) and ``build(target="pipeline")`` keeps the copies
    equal."""
    root = sch.root
    gm = root.mod
    if state.is_pipeline_partition(gm):  # generate_pipeline_partition has split it already
        return list(gm.children())
    if not isinstance(gm, fx.GraphModule):
        raise ValueError(f"a pipeline needs the traced model: call trace() on the schedule root "
                         f"({type(gm).__name__}) before build(target='pipeline')")
    cuts = pipeline_cuts(root)
    if not cuts:
        raise ValueError("no pipeline cuts: call sch['<module path>'].cut_pipeline_stage() on "
                         "the module after which a stage ends")
    graph = copy.deepcopy(gm.graph)
    # the deepest paths first: a cut after a traced module (T5's encoder) whose graph a cut
    # inside it has inlined is a cut after the last node of that inlined graph
    inlined: dict[str, fx.Node] = {}
    cut_nodes = [_reach(graph, gm, path, inlined)
                 for path in sorted(cuts, key=lambda path: -path.count("."))]
    order = {n: i for i, n in enumerate(graph.nodes)}
    cut_nodes.sort(key=order.__getitem__)
    stage_of = _assign_stages(graph, cut_nodes)
    _carry_non_tensors(graph, stage_of, len(cut_nodes) + 1, cuts=[n.target for n in cut_nodes])
    stages = _build_stage_modules(gm, graph, stage_of, len(cut_nodes) + 1)
    for k, stage in enumerate(stages):
        if not any(n.op.startswith("call_") for n in stage.graph.nodes):
            where = f"after '{cut_nodes[k - 1].target}'" if k else "before the first"
            raise ValueError(f"pipeline stage {k} (the cut {where}) would compute nothing: "
                             "a cut after the model's last operation, or two cuts with "
                             "nothing between them; move or drop the cut")
    shared = shared_parameters(stages)
    if shared and not tied:
        names = ", ".join(f"'{name}' (stage {k})" for k, name in shared[0])
        raise ValueError(f"one parameter is used by several stages: {names}; a parameter "
                         "must live in one stage (untie shared weights or move the cut)")
    return stages


def _reach(graph: fx.Graph, gm: fx.GraphModule, path: str, inlined: dict) -> fx.Node:
    """The call of module ``path`` in ``graph``, inlining nested GraphModules to reach it
    (``inlined``: the last node of each module inlined so far, which stands for its call)."""
    while True:
        if path in inlined:
            return inlined[path]
        calls = [n for n in graph.nodes if n.op == "call_module" and n.target == path]
        if len(calls) > 1:
            raise ValueError(f"'{path}' is called {len(calls)} times; a pipeline cut needs a "
                             "module called once")
        if calls:
            return calls[0]
        outer = [n for n in graph.nodes if n.op == "call_module"
                 and path.startswith(n.target + ".")]
        if not outer:
            raise ValueError(f"the traced model does not call '{path}' or a module around it; "
                             "cut after a module the traced graph calls")
        call = outer[0]
        mod = gm.get_submodule(call.target)
        if not isinstance(mod, fx.GraphModule) or has_foreign_hooks(mod) or \
                state.is_leaf(mod):
            raise ValueError(f"cannot cut inside '{call.target}' ({type(mod).__name__}): it is "
                             "not a plain traced graph (untraced, a leaf, or changed by a "
                             "primitive such as checkpoint); cut at its level instead")
        replaced = _inline(graph, call, mod)
        for name, node in list(inlined.items()):  # an earlier module's last node is gone
            inlined[name] = replaced.get(node, node)
        inlined[call.target] = replaced[call]


def _inline(graph: fx.Graph, call: fx.Node, child: fx.GraphModule) -> dict[fx.Node, fx.Node]:
    """Put ``child``'s graph in place of its ``call``; returns the nodes it removed, each with
    the node now in its place (the call's: the last node put in)."""
    prefix = call.target
    placeholders = [n for n in child.graph.nodes if n.op == "placeholder"]
    values = list(call.args) + [call.kwargs[p.target] for p in placeholders[len(call.args):]]
    env: dict[fx.Node, Any] = dict(zip(placeholders, values))
    result, last = None, call.prev
    with graph.inserting_before(call):
        for n in child.graph.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                result = fx.node.map_arg(n.args[0], env.__getitem__)
                continue
            new = last = graph.node_copy(n, env.__getitem__)
            if new.op in ("call_module", "get_attr"):
                new.target = f"{prefix}.{n.target}"
            env[n] = new
    replaced = {call: last}
    for user in list(call.users):
        if isinstance(result, (tuple, list)) and user.op == "call_function" and \
                user.target is operator.getitem and user.args[0] is call:
            user.replace_all_uses_with(result[user.args[1]])
            replaced[user] = result[user.args[1]]
            graph.erase_node(user)
        elif isinstance(result, fx.Node):
            user.replace_input_with(call, result)
        else:
            with graph.inserting_before(user):
                packed = graph.call_function(type(result), (list(result),)) \
                    if isinstance(result, (tuple, list)) else \
                    graph.call_function(dict, (), dict(result))
            user.replace_input_with(call, packed)
    graph.erase_node(call)
    return replaced


def _assign_stages(graph: fx.Graph, cut_nodes: list[fx.Node]) -> dict[fx.Node, int]:
    cuts = set(cut_nodes)
    stage, stage_of = 0, {}
    for n in graph.nodes:
        if n.op in ("placeholder", "get_attr", "output"):
            continue
        stage_of[n] = stage
        if n in cuts:
            stage += 1
    for n in graph.nodes:
        if n.op == "placeholder":
            stage_of[n] = 0
    return stage_of


# --- values other than tensors that cross a cut ------------------------------------------
# torch.distributed.pipelining sends tensors only, and a stage after the first learns their
# shapes first (it runs its forward once on empty tensors of those shapes). So a Python value
# crosses as a tensor with no elements whose metadata holds it exactly: an int n as shape
# (n, 0), a torch.Size s as shape (*(s + 1), 0) (each size plus one, so that a view's -1
# crosses), a bool as (0 or 1, 0), a dtype as the dtype, a device as the device (the
# receiving stage's own). Nothing is communicated but metadata,
# and the value is right even in that first, empty run. A tuple or list crosses item by item
# and is rebuilt where it is used; None is None in the stage that uses it. Of a value whose
# later users each read one item of it (x[0], x["name"], x.name) only those items cross; a
# ModelOutput built in the graph is built again in each later stage from its fields.
CARRIED = ("int", "bool", "Size", "dtype", "device")


def to_carrier(value, like: torch.Tensor, kind: str, what: str) -> torch.Tensor:
    """The empty tensor that carries ``value`` (of ``kind``) across a cut, on ``like``'s
    device; ``what`` names the value and the cut in errors."""
    if kind == "device":
        return torch.empty(0, dtype=torch.int8, device=value)
    if kind == "dtype":
        return torch.empty(0, dtype=value, device=like.device)
    if kind == "Size":  # shifted by one: a view's -1 ("infer this size") crosses as 0
        if any(size < -1 for size in value):
            raise ValueError(f"{what} is {value!r} at run time; a size below -1 cannot cross "
                             "a pipeline cut")
        return torch.empty((*(size + 1 for size in value), 0), dtype=torch.int8,
                           device=like.device)
    if type(value) is not (bool if kind == "bool" else int) or value < 0:
        raise ValueError(f"{what} is {value!r} at run time; only a non-negative {kind} (as "
                         "traced) can cross a pipeline cut")
    return torch.empty((int(value), 0), dtype=torch.int8, device=like.device)


def from_carrier(carrier: torch.Tensor, kind: str):
    """The value ``to_carrier`` put in ``carrier``."""
    if kind == "device":
        return carrier.device
    if kind == "dtype":
        return carrier.dtype
    if kind == "Size":
        return torch.Size(size - 1 for size in carrier.shape[:-1])
    return bool(carrier.shape[0]) if kind == "bool" else int(carrier.shape[0])


def _carry_non_tensors(graph: fx.Graph, stage_of: dict[fx.Node, int], num_stages: int,
                       cuts: list[str]) -> None:
    """Rewrite ``graph`` so that only tensors cross its cuts (see above); a value that cannot
    cross is an error naming it and the cut."""
    pending = [n for n in graph.nodes if n in stage_of]
    while pending:
        n = pending.pop(0)
        stage = stage_of[n]
        later: dict[int, list[fx.Node]] = {}  # stage -> its nodes that use n
        for user in n.users:
            k = stage_of.get(user, num_stages - 1)  # the output node: the last stage
            if k > stage:
                later.setdefault(k, []).append(user)
        kind = n.meta.get(KIND, "unknown")
        if not later or kind == "tensor":
            continue
        what = (f"the value '{n.name}' ({kind}) that crosses the pipeline cut after "
                f"'{cuts[stage]}'")
        picks = [u for users in later.values() for u in users]
        if kind == "none":
            for user in picks:
                user.args, user.kwargs = fx.node.map_arg((user.args, user.kwargs),
                                                         _replacing(n, None))
        elif all(_takes_item(u, kind) for u in picks):
            # only some items of n are used later: take them out here (also where n's kind
            # is unknown: a layer of a model on the meta device whose sync could not run
            # while tracing returns a tuple whose first item crosses; and for the fields of
            # a ModelOutput, T5's encoder output)
            for user in picks:
                stage_of[user] = stage
        elif n.op == "call_function" and _builds_model_output(n):
            # a transformers ModelOutput (T5's encoder output, used by the decoder's stages):
            # built again in each later stage that uses it, so that its fields cross instead
            _rebuild_in_stages(graph, n, later, stage_of, n.target, n.args, n.kwargs)
            pending[:0] = n.all_input_nodes  # whether each field crosses, decided again
        elif kind == "unknown":
            continue  # taken to be a tensor
        elif kind in ("tuple", "list") and ITEMS in n.meta:
            items = _split_items(graph, n, stage_of)
            _rebuild_in_stages(graph, n, later, stage_of, tuple if kind == "tuple" else list,
                               (items,))
            pending[:0] = items
        elif kind in CARRIED:
            like = _tensor_ancestor(n)
            if like is None:
                raise ValueError(f"{what} comes from no tensor the stage has; move the cut")
            with graph.inserting_after(n):
                carrier = graph.call_function(to_carrier, (n, like, kind, what))
            carrier.meta[KIND] = "tensor"
            stage_of[carrier] = stage
            _rebuild_in_stages(graph, n, later, stage_of, from_carrier, (carrier, kind))
        else:
            unknown = "; its items are unknown" if kind in ("tuple", "list") else ""
            raise ValueError(f"{what} cannot be passed between stages (they exchange tensors, "
                             f"{', '.join(CARRIED)}, None, and tuples or lists of them"
                             f"{unknown}); move the cut, or make the value a tensor")


def _replacing(old: fx.Node, new):
    return lambda a: new if a is old else a


def _split_items(graph: fx.Graph, n: fx.Node, stage_of) -> list[fx.Node]:
    """``n[0]``, ``n[1]``, ... as nodes of ``n``'s stage, each with its traced kind."""
    items, anchor = [], n
    for i, item in enumerate(n.meta[ITEMS]):
        with graph.inserting_after(anchor):
            anchor = graph.call_function(operator.getitem, (n, i))
        anchor.meta[KIND], sub = (item, None) if isinstance(item, str) else item
        if sub is not None:
            anchor.meta[ITEMS] = sub
        stage_of[anchor] = stage_of[n]
        items.append(anchor)
    return items


def _takes_item(n: fx.Node, kind: str) -> bool:
    """Whether ``n`` reads one item of a value of ``kind``: ``x[i]``, or, of a value whose kind
    is known (a ModelOutput), ``x["name"]`` or ``x.name`` (of an unknown one, a tensor maybe,
    ``x.dtype`` would cross as a value of unknown kind)."""
    if n.op != "call_function" or len(n.args) != 2:
        return False
    if n.target is operator.getitem and isinstance(n.args[1], int):
        return True
    return kind != "unknown" and isinstance(n.args[1], str) and \
        n.target in (operator.getitem, getattr)


def _builds_model_output(n: fx.Node) -> bool:
    """Whether ``n`` constructs a transformers ModelOutput (a dataclass that is a dict; the
    tracer records one so, with the fields that are set as keyword arguments)."""
    return isinstance(n.target, type) and is_dataclass(n.target) and issubclass(n.target, dict)


def _rebuild_in_stages(graph, n, later, stage_of, target, args, kwargs=None) -> None:
    """In each later stage that uses ``n``, one node ``target(*args, **kwargs)`` (inserted
    before the stage's first use) takes ``n``'s place."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    for k, users in later.items():
        with graph.inserting_before(min(users, key=order.__getitem__)):
            value = graph.call_function(target, args, kwargs or {})
        value.meta.update({key: n.meta[key] for key in (KIND, ITEMS) if key in n.meta})
        stage_of[value] = k
        for user in users:
            user.replace_input_with(n, value)


def _tensor_ancestor(n: fx.Node) -> fx.Node | None:
    """The nearest tensor that ``n`` is computed from (its device is the stage's)."""
    seen, queue = {n}, list(n.all_input_nodes)
    while queue:
        a = queue.pop(0)
        if a in seen:
            continue
        seen.add(a)
        if a.meta.get(KIND) == "tensor":
            return a
        queue.extend(a.all_input_nodes)
    return None


def _build_stage_modules(gm, graph, stage_of, num_stages) -> list[fx.GraphModule]:
    nodes = list(graph.nodes)
    output = nodes[-1]
    placeholders = [n for n in nodes if n.op == "placeholder"]

    def users_stages(n):
        return [stage_of.get(u, num_stages - 1) for u in n.users]  # output: last stage

    stages = []
    live_in = placeholders
    for k in range(num_stages):
        last = k == num_stages - 1
        live_out = [] if last else [
            n for n in nodes if n in stage_of and stage_of[n] <= k
            and any(s > k for s in users_stages(n))]
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for n in live_in:
            env[n] = g.placeholder(n.name)
            env[n].meta[KIND] = n.meta.get(KIND, "unknown")

        def lookup(a, env=env, g=g):
            if a not in env and a.op == "get_attr":
                env[a] = g.node_copy(a)
            return env[a]

        for n in nodes:
            if stage_of.get(n) == k and n.op != "placeholder":
                env[n] = g.node_copy(n, lookup)
        if last:
            g.output(fx.node.map_arg(output.args[0], lookup))
        else:  # sent as they are, and a send takes a contiguous tensor
            g.output(tuple(g.call_function(contiguous, (env[n],)) for n in live_out))
        g.lint()
        stages.append(fx.GraphModule(gm, g, class_name=f"Stage{k}"))
        live_in = live_out
    return stages


def contiguous(value):
    """``value``, a tensor made contiguous (T5's position bias leaves its first stage as a
    permuted view, which a pipeline's send refuses)."""
    return value.contiguous() if isinstance(value, torch.Tensor) else value


def shared_parameters(stages: list[fx.GraphModule]) -> list[list[tuple[int, str]]]:
    """Each parameter that more than one of ``stages`` holds, as its holders ``(stage, name)``
    in stage order; the parameters in the order of their first holder."""
    owners: dict[int, dict[int, str]] = {}
    for k, stage in enumerate(stages):
        for name, param in stage.named_parameters(remove_duplicate=False):
            owners.setdefault(id(param), {}).setdefault(k, name)
    return sorted(sorted(where.items()) for where in owners.values() if len(where) > 1)


def generate_pipeline_partition(sch):
    """Upstream Slapo's pipeline partition: split the traced root ``sch`` at its cuts (as
    ``split_stages``) and make the root's module a GraphModule whose children
    ``submod_0``, ``submod_1``, ... are the stage modules, its forward calling them in turn
    (stage k's outputs are stage k+1's inputs). The model computes what it computed; each
    node of the new schedule tree carries ``partition_idx``, the stage it belongs to.
    Returns ``sch``. ``build(sch, target="pipeline")`` takes a partitioned schedule as well.
    """
    if sch.parent is not None:
        raise ValueError(f"generate_pipeline_partition takes the schedule root, not "
                         f"'{sch.path}'")
    if state.is_pipeline_partition(sch.mod):
        raise ValueError("the schedule is already partitioned into pipeline stages")
    stages = split_stages(sch)
    top = _chain_stages(sch.mod, stages)
    sch.replace(top)
    state.mark_pipeline_partition(top)
    for index, child in enumerate(sch.child.values()):
        for _, node in child.named_schedules():
            node.partition_idx = index
    return sch


def _chain_stages(gm: fx.GraphModule, stages: list[fx.GraphModule]) -> fx.GraphModule:
    """One GraphModule with the model's inputs that runs ``stages`` one after another."""
    graph = fx.Graph()
    values = [graph.node_copy(n) for n in gm.graph.nodes if n.op == "placeholder"]
    for k in range(len(stages)):
        out = graph.call_module(f"submod_{k}", tuple(values))
        if k + 1 < len(stages):  # a middle stage returns the tuple of the next one's inputs
            inputs = sum(n.op == "placeholder" for n in stages[k + 1].graph.nodes)
            values = [graph.call_function(operator.getitem, (out, i)) for i in range(inputs)]
    graph.output(out)
    graph.lint()
    children = {f"submod_{k}": stage for k, stage in enumerate(stages)}
    return fx.GraphModule(children, graph, class_name="PipelinePartition")
