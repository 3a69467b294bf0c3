"""Automatic sharding: upstream Slapo's ``slapo.sharding.Solver``.

The solver chooses, for a traced graph and ``p`` devices, how each activation is split so that
the communication a tensor-parallel schedule needs is least, under upstream's cost model:

- A layout names the last two axes of a tensor: ``RR`` = 0 (replicated), ``RS`` = 1 (the
  last axis split into ``p`` slices), ``SR`` = 2 (the axis before it split; as views and
  permutes pass it along, it stands for a split of any axis but the last).
- Each op that has a choice gets one z3 variable per operand, ``<node>_<i>``: the layout that
  operand is resharded to before the op (a linear's second one, ``<node>_1``, is its weight,
  read as the ``(in, out)`` matrix of ``x @ W``). ``RULES`` says, per op, which layouts it
  accepts, what layout its output then has and what it communicates itself.
- Resharding an operand from the layout its producer gave it costs a share of the tensor's
  elements (``RESHARD``): gathering a split tensor ``1/p``, moving the split to the other axis
  ``1/p - 1/p**2``, and splitting a replicated one, which needs no communication, a token 1
  (it is a schedule change all the same). The values the graph computes last (that nothing in
  it reads further) are resharded to ``RR``.
- The total is minimised exactly (``z3.Optimize``); z3 is needed only here (``pip install
  slapo[solver]``).

``Solver(gm, p).solve([example_input, ...])`` returns the variables' layouts and the least
cost; ``Solver.schedule()`` then gives the primitives that realise it (``shard`` of the linears,
``sync`` where a module's input or output is resharded, ``reshard`` at other nodes).
"""

from __future__ import annotations

import copy
import functools
import logging
import operator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp, TensorMetadata
from torch.utils._pytree import tree_leaves

from .reshard import LAYOUTS

logger = logging.getLogger(__name__)

RR, RS, SR = range(3)


def reshard_cost(src: int, dst: int, numel: int, p: int) -> int:
    """Upstream's cost of moving a tensor of ``numel`` elements from layout ``src`` to ``dst``."""
    if src == dst:
        return 0
    if src == RR:
        return 1  # a local split: no traffic, a token cost so that needless splits lose
    if dst == RR:
        return numel // p  # all-gather
    return numel * (p - 1) // (p * p)  # all-to-all, RS <-> SR


class UnsupportedOpError(RuntimeError):
    """The solver's cost model has no rule for an op of the graph."""


@dataclass
class _Value:
    """A tensor the graph computes: its size and its layout (an int or a z3 expression)."""
    node: fx.Node
    numel: int
    ndim: int
    layout: object = RR
    operands: list = field(default_factory=list)  # (producer _Value or None, z3 variable)
    comm: object = 0  # what the op communicates itself


class _Model:
    """The z3 problem being built: variables, constraints and cost terms."""

    def __init__(self, z3, p: int, modules: dict[str, nn.Module]):
        self.z3, self.p, self.modules = z3, p, modules
        self.constraints, self.costs = [], []
        self.variables = {}

    def operand(self, value: _Value, index: int, producer: _Value | None,
                allowed=(RR, RS, SR)):
        """A variable for operand ``index`` of ``value``'s op, limited to ``allowed`` layouts,
        charged for resharding from its producer (a weight has none)."""
        z3 = self.z3
        var = z3.Int(f"{value.node.name}_{index}")
        self.variables[str(var)] = var
        self.constraints.append(z3.Or([var == layout for layout in allowed]))
        value.operands.append((producer, var))
        if producer is not None:
            self.costs.append(self.reshard(producer.layout, var, producer.numel))
        return var

    def module(self, node: fx.Node) -> nn.Module:
        return self.modules[node.target]

    def select(self, key, table: dict, default=0):
        """``table[key]`` as a z3 expression (``default`` for a key not in the table)."""
        expr = default
        for k, v in table.items():
            expr = self.z3.If(key == k, v, expr)
        return expr

    def reshard(self, src, dst, numel: int):
        return self.select(src, {s: self.select(dst, {d: reshard_cost(s, d, numel, self.p)
                                                      for d in range(3)})
                                 for s in range(3)})


# --- Rules: each takes (model, value, operand values) and sets the value's layout and comm ---

def _replicated(m, v, ins):
    """Inputs, buffers, constants: the same on every device."""
    v.layout = RR


def _elementwise(m, v, ins):
    """Element by element (or a cast, a copy): on one tensor the layout stays; several tensors
    are resharded to one layout, which the output keeps. Python numbers and 0-d tensors do not
    count: a scalar is the same on every device and meets any layout."""
    ins = [x for x in ins if x.ndim > 0] or ins[:1]
    if not ins:
        v.layout = RR
    elif len(ins) == 1:
        v.layout = ins[0].layout
    else:
        first, *rest = (m.operand(v, i, x) for i, x in enumerate(ins))
        m.constraints += [var == first for var in rest]
        v.layout = first


def _matmul(m, v, ins):
    """``x @ W`` (a linear, whose weight has no producer, or a matmul of two activations):
    column-parallel RR x RS -> RS; row-parallel RS x SR -> RR plus an all-reduce of the output;
    split rows SR x RR -> SR. A replicated product is not offered (as upstream)."""
    z3 = m.z3
    x = m.operand(v, 0, ins[0])
    w = m.operand(v, 1, ins[1] if len(ins) > 1 else None)
    pairs = {RR: RS, RS: SR, SR: RR}
    m.constraints.append(z3.Or([z3.And(x == a, w == b) for a, b in pairs.items()]))
    v.layout = m.select(x, {RR: RS, RS: RR, SR: SR})
    v.comm = m.select(x, {RS: v.numel})


def _reduce_along(m, v, ins, axes):
    """A reduction along ``axes`` (layer norm, softmax): those axes cannot be split."""
    banned = {-1: RS, -2: SR}
    allowed = [i for i in range(3) if i not in {banned[a] for a in axes if a in banned}]
    v.layout = m.operand(v, 0, ins[0], allowed)


def _layer_norm(m, v, ins):
    shape = m.module(v.node).normalized_shape
    _reduce_along(m, v, ins, axes=tuple(range(-len(shape), 0)))


def _softmax(m, v, ins):
    node = v.node
    if node.op == "call_module":
        dim = m.module(node).dim
    else:
        dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
    if dim is None:
        raise UnsupportedOpError(f"Solver: softmax '{node.name}' has no dim")
    ndim = ins[0].ndim
    _reduce_along(m, v, ins, axes=(dim - ndim if dim >= 0 else dim,))


def _view(m, v, ins):
    """A view or reshape of the (batch, seq, hidden) kind: any layout, but a split last axis
    is gathered first (upstream: reshaping the split axis would mix the slices), charged
    ``numel / p`` on top of the resharding unless the view's result is SR."""
    src = ins[0]
    var = m.operand(v, 0, src)
    v.layout = var
    v.comm = m.z3.If(m.z3.And(src.layout == RS, var != SR), v.numel // m.p, 0)


def _move_axes(m, v, ins):
    """A transpose or permute: the layout stays while the last axis stays last (the axis
    before it is then some axis but the last, as views pass it); swapping the last two axes
    swaps RS and SR."""
    node = v.node
    ndim = ins[0].ndim
    order = list(range(ndim))
    if node.target == "transpose" or node.target is torch.transpose:
        a, b = (d % ndim for d in node.args[1:3])
        order[a], order[b] = order[b], order[a]
    else:  # permute(*dims) or permute(dims)
        dims = node.args[1:] if not isinstance(node.args[1], (list, tuple)) else node.args[1]
        order = [d % ndim for d in dims]
    last, before = ndim - 1, ndim - 2
    if order[-1] == last:
        v.layout = ins[0].layout
    elif order[-1] == before and order[-2] == last:
        v.layout = m.select(ins[0].layout, {RR: RR, RS: SR, SR: RS})
    else:
        raise UnsupportedOpError(f"Solver: '{node.name}' ({node.target}) moves the last axis "
                                 "elsewhere than second to last, which the layouts cannot "
                                 "follow")


def _attention(m, v, ins):
    """Scaled dot-product attention as upstream's rules take ``softmax(q @ k^T) @ v``: the
    query rows split (SR), keys and values whole (RR), the output split like the query. (A
    split of keys and values as well, head-parallel, is not offered: SR cannot tell a split of
    heads from a split of the sequence, and a sequence split of keys would be wrong.) A mask
    follows the query rows."""
    m.operand(v, 0, ins[0], [SR])
    for i, x in enumerate(ins[1:3], start=1):
        m.operand(v, i, x, [RR])
    for i, x in enumerate(ins[3:], start=3):
        m.operand(v, i, x, [SR])
    v.layout = SR


def _index(m, v, ins):
    """Indexing or slicing a tensor: only a replicated one (a slice of a split axis would need
    to know the split)."""
    v.layout = m.operand(v, 0, ins[0], [RR])


# Ops that work element by element (casts and copies too): modules, functions, method names.
ELEMENTWISE = (
    nn.Dropout, nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh, nn.Identity,
    F.dropout, F.gelu, F.relu, F.silu, torch.tanh, torch.exp, torch.sigmoid, torch.pow,
    torch.add, torch.mul, torch.where,
    operator.add, operator.sub, operator.mul, operator.truediv, operator.pow, operator.neg,
    "contiguous", "to", "float", "half",
)
# Functions that make a tensor from Python values: the same on every device.
FACTORIES = (torch.tensor, torch.zeros, torch.ones, torch.full, torch.arange)

# The rule of each op of a graph, by module class, function or method name.
RULES = {
    nn.Linear: _matmul, torch.matmul: _matmul, operator.matmul: _matmul,
    nn.LayerNorm: _layer_norm,
    nn.Softmax: _softmax, F.softmax: _softmax, torch.softmax: _softmax, "softmax": _softmax,
    F.scaled_dot_product_attention: _attention,
    "view": _view, "reshape": _view,
    "transpose": _move_axes, "permute": _move_axes,
    torch.transpose: _move_axes, torch.permute: _move_axes,
    operator.getitem: _index,
    **dict.fromkeys(ELEMENTWISE, _elementwise),
    **dict.fromkeys(FACTORIES, _replicated),
}


@dataclass(frozen=True)
class Step:
    """One primitive the solution asks for: ``primitive`` is ``"shard"``, ``"sync"`` (both on
    the schedule node ``target``, a module path; ``kwargs`` are the primitive's arguments) or
    ``"reshard"`` (``slapo.sharding.reshard`` of the graph value ``target`` with
    ``kwargs["scheme"]``, where ``kwargs["before"]`` reads it)."""
    primitive: str
    target: str
    kwargs: dict

    def __str__(self):
        if self.primitive == "reshard":
            return (f"reshard({self.target}, {self.kwargs['scheme']!r})  "
                    f"# before {self.kwargs['before']}")
        args = ", ".join(f"{k}={v!r}" for k, v in self.kwargs.items())
        return f'sch["{self.target}"].{self.primitive}({args})'


class Solver:
    """Upstream Slapo's automatic sharding of a traced ``fx.GraphModule`` over ``p`` devices
    (see the module doc)."""

    def __init__(self, gm: fx.GraphModule, p: int):
        if not isinstance(gm, fx.GraphModule):
            raise TypeError(f"Solver needs a traced fx.GraphModule (sch.trace()), got "
                            f"{type(gm).__name__}")
        if not isinstance(p, int) or p < 2:
            raise ValueError(f"Solver needs p >= 2 devices, got {p!r}")
        self.gm, self.p = gm, p
        self.modules = dict(gm.named_modules())
        self.values: dict[str, _Value] = {}
        self.results: dict[str, int] | None = None
        self.cost: int | None = None

    def solve(self, inputs, max_iter: int = 100) -> tuple[dict[str, int], int]:
        """The least-cost layouts for the graph run on ``inputs`` (example tensors, only their
        shapes and dtypes count): ``({"<node>_<i>": layout id}, cost)``. ``max_iter`` is
        upstream's bound on its improvement loop; z3's optimiser needs none, so it is unused."""
        try:
            import z3
        except ImportError as err:
            raise ImportError("slapo.sharding.Solver needs z3: pip install 'slapo[solver]' "
                              "(z3-solver)") from err
        graph = self._graph_with_shapes(inputs)
        m = _Model(z3, self.p, self.modules)
        self._build(m, graph)
        total = z3.Sum(m.costs) if m.costs else z3.IntVal(0)
        opt = z3.Optimize()
        opt.add(m.constraints)
        opt.minimize(total)
        if opt.check() != z3.sat:
            raise RuntimeError("Solver: no layout satisfies the graph's rules")
        model = opt.model()
        self.results = {name: model.eval(var, model_completion=True).as_long()
                        for name, var in m.variables.items()}
        self.cost = model.eval(total).as_long()
        self._z3model = model
        logger.info("Solver: least cost %d over %d devices\n%s", self.cost, self.p,
                    "\n".join(map(str, self.schedule())))
        return dict(self.results), self.cost

    def layout(self, node_name: str) -> str:
        """The layout of a graph value in the solution, e.g. ``"SR"``."""
        return LAYOUTS[self._eval(self.values[node_name].layout)]

    def schedule(self) -> list[Step]:
        """The primitives that realise the solution, in graph order."""
        if self.results is None:
            raise RuntimeError("Solver.schedule() needs solve() first")
        steps = []
        for value in self.values.values():
            node = value.node
            module = self.modules.get(node.target) if node.op == "call_module" else None
            if isinstance(module, nn.Linear):
                steps += self._linear_steps(node, value)
            for producer, var in value.operands:
                if producer is None:
                    continue
                src, dst = self._eval(producer.layout), self._eval(var)
                if src != dst:
                    steps.append(self._reshard_step(node, module, "fwd_pre", src, dst,
                                                    producer.node))
            if self._is_last(node):
                src = self._eval(value.layout)
                if src != RR:
                    steps.append(self._reshard_step(node, module, "fwd_post", src, RR))
        return steps

    # --- building the model ---

    def _graph_with_shapes(self, inputs) -> fx.Graph:
        """The graph with the shape of every value for ``inputs``, propagated on the meta
        device (nothing is computed or allocated) through a copy of the module whose
        parameters and buffers are meta tensors; the module itself is left as it is."""
        memo = {}
        tensors = [*self.gm.parameters(), *self.gm.buffers(),
                   *(functools.reduce(getattr, n.target.split("."), self.gm)
                     for n in self.gm.graph.nodes if n.op == "get_attr")]
        for t in tensors:
            if isinstance(t, torch.Tensor) and id(t) not in memo:
                meta = t.detach().to("meta")
                memo[id(t)] = nn.Parameter(meta, t.requires_grad) \
                    if isinstance(t, nn.Parameter) else meta
        names = [n.name for n in self.gm.graph.nodes if n.op == "placeholder"]
        if len(inputs) != len(names):
            raise ValueError(f"Solver.solve: the graph takes {len(names)} inputs "
                             f"({', '.join(names)}), got {len(inputs)}")
        meta_gm = copy.deepcopy(self.gm, memo)
        ShapeProp(meta_gm).propagate(*(x.to("meta") if isinstance(x, torch.Tensor) else x
                                       for x in inputs))
        return meta_gm.graph

    @staticmethod
    def _live_nodes(graph: fx.Graph) -> set[fx.Node]:
        """The nodes the graph's output depends on."""
        out = next(n for n in reversed(graph.nodes) if n.op == "output")
        live, todo = set(), [out]
        while todo:
            node = todo.pop()
            if node not in live:
                live.add(node)
                todo += node.all_input_nodes
        return live

    def _build(self, m: _Model, graph: fx.Graph):
        live = self._live_nodes(graph)
        self.values = {}
        for node in graph.nodes:
            meta = node.meta.get("tensor_meta")
            if node not in live or node.op == "output" or meta is None:
                continue  # sizes, dtypes and other Python values carry no layout
            if not isinstance(meta, TensorMetadata):
                raise UnsupportedOpError(f"Solver: '{node.name}' ({self._describe(node)}) "
                                         "returns several tensors, which the cost model does "
                                         "not follow")
            value = _Value(node, int(torch.Size(meta.shape).numel()), len(meta.shape))
            ins = [self.values[a.name] for a in tree_leaves((node.args, node.kwargs))
                   if isinstance(a, fx.Node) and a.name in self.values]
            self._rule(node)(m, value, ins)
            m.costs.append(value.comm)
            self.values[node.name] = value
        for value in self.values.values():
            if self._is_last(value.node):
                m.costs.append(m.reshard(value.layout, RR, value.numel))

    def _rule(self, node: fx.Node):
        if node.op in ("placeholder", "get_attr"):
            return _replicated
        key = type(self.modules[node.target]) if node.op == "call_module" else node.target
        rule = RULES.get(key)
        if rule is None and node.op == "call_module":  # a subclass of a known module
            rule = next((r for k, r in RULES.items()
                         if isinstance(k, type) and isinstance(self.modules[node.target], k)), None)
        if rule is None:
            raise UnsupportedOpError(f"Solver: unsupported {node.op.replace('_', ' ')} "
                                     f"'{node.name}' ({self._describe(node)}): the cost model "
                                     "has no rule for it (slapo.sharding.solver.RULES)")
        return rule

    def _describe(self, node: fx.Node) -> str:
        if node.op == "call_module":
            return f"{node.target}: {type(self.modules[node.target]).__name__}"
        return getattr(node.target, "__name__", str(node.target))

    def _is_last(self, node: fx.Node) -> bool:
        """Whether nothing in the graph reads this value further."""
        return not any(user.name in self.values for user in node.users)

    # --- reading the solution ---

    def _eval(self, expr) -> int:
        if isinstance(expr, int):
            return expr
        return self._z3model.eval(expr, model_completion=True).as_long()

    def _linear_steps(self, node, value) -> list[Step]:
        x, w = self.results[f"{node.name}_0"], self.results[f"{node.name}_1"]
        has_bias = self.modules[node.target].bias is not None
        if w == RS:  # column-parallel: the output features, i.e. the weight's rows
            return [Step("shard", node.target,
                         {"param_names": ["weight", "bias"] if has_bias else "weight",
                          "axis": 0})]
        if w == SR:  # row-parallel: the input features, then the partial sums all-reduced
            steps = [Step("shard", node.target, {"param_names": "weight", "axis": 1})]
            if x == RS:
                steps.append(Step("sync", node.target,
                                  {"mode": "fwd_post", "sync_op_or_fn": "all_reduce"}))
            return steps
        return []

    def _reshard_step(self, node, module, mode, src, dst, operand=None) -> Step:
        """Resharding ``operand`` before ``node`` (``fwd_pre``) or ``node``'s output after it
        (``fwd_post``): a ``sync`` of a module, else a ``reshard`` of the graph value."""
        scheme = f"{LAYOUTS[src]}->{LAYOUTS[dst]}"
        if module is not None:
            return Step("sync", node.target, {"mode": mode, "sync_op_or_fn": scheme})
        if mode == "fwd_pre":
            return Step("reshard", operand.name, {"scheme": scheme, "before": node.name})
        return Step("reshard", node.name, {"scheme": scheme, "before": "the graph's output"})
