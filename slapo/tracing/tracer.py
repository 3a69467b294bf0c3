"""The tracer: ``torch.fx`` symbolic tracing that keeps the module hierarchy.

``SlapoTracer`` decides what is a leaf, traces each non-leaf submodule into its own
GraphModule where its parent calls it, computes every node's example value (read by the
proxies), and patches torch constructors so traced sizes reach them. ``trace_module`` runs it
and builds the result. This is the part that drives fx; values, call plans and the call
adapter are in their own modules.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import warnings
from collections.abc import Callable, Iterable
from dataclasses import fields, is_dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.fx.node import map_aggregate
from torch.utils import _pytree as pytree

from .. import state
from .adapter import CallAdapter, adapter_of
from .call_plan import CallPlan, Slot, plan_for_call, plan_for_root
from .errors import TraceError
from .proxies import (
    ITEMS,
    KIND,
    META,
    UNKNOWN,
    MetaProxy,
    UnknownMeta,
    items_of,
    kind_of,
    meta_of,
    to_meta,
)

# torch constructors that take no tensor argument: patched while tracing so that a traced
# size or device (``torch.arange(seq_len, device=x.device)``) becomes a graph node.
_CONSTRUCTORS = ("arange", "zeros", "ones", "full", "empty", "tensor", "eye", "rand", "randn",
                 "randint", "linspace")
_TRACED_FROM = "slapo_traced_from"  # GraphModule.meta key: the class of the traced module
_FLATTENED = "slapo_flattened"  # GraphModule.meta key: True when traced with flatten=True


# --- patching torch constructors --------------------------------------------------------
def _constructor_wrapper(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def wrapper(*args, **kwargs):
        proxies = [v for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, fx.Proxy)]
        if proxies:
            return proxies[0].tracer.create_proxy("call_function", orig, args, kwargs)
        return orig(*args, **kwargs)
    state.mark_constructor_wrapper(wrapper)
    return wrapper


class _PatchConstructors:
    """While tracing, the constructors in _CONSTRUCTORS accept traced arguments. A nested
    trace (a submodule traced on its own) finds them patched already and keeps them."""

    def __enter__(self):
        self.saved = {}
        for name in _CONSTRUCTORS:
            orig = getattr(torch, name)
            if not state.is_constructor_wrapper(orig):
                self.saved[name] = orig
                setattr(torch, name, _constructor_wrapper(orig))
        return self

    def __exit__(self, *exc):
        for name, orig in self.saved.items():
            setattr(torch, name, orig)


# --- hooks that make a module a leaf ---------------------------------------------------
# Hooks that do nothing unless their library asks for it, and that tracing may drop:
# transformers installs them to collect attentions/hidden states on request.
_INERT_HOOK_MODULES = ("transformers.utils.output_capturing",)


def is_inert_hook(hook) -> bool:
    """slapo's call adapter, or a hook of transformers' output capturing: plumbing that
    tracing may drop, not a hook that changes what the module computes."""
    return isinstance(hook, CallAdapter) or \
        getattr(hook, "__module__", "").startswith(_INERT_HOOK_MODULES)


def has_foreign_hooks(mod: nn.Module) -> bool:
    """Hooks from primitives or users (not slapo's call adapter, not transformers' output
    capturing), or a forward patched on the instance."""
    hooks = [*mod._forward_pre_hooks.values(), *mod._forward_hooks.values(),
             *mod._backward_hooks.values(), *mod._backward_pre_hooks.values()]
    return "forward" in mod.__dict__ or any(not is_inert_hook(h) for h in hooks)


def _stateless(m: nn.Module) -> bool:
    """No parameters or buffers (an activation function): traced into its caller's graph."""
    return next(m.parameters(), None) is None and next(m.buffers(), None) is None


# --- the tracer -------------------------------------------------------------------------
class SlapoTracer(fx.Tracer):
    """fx tracer with example-value propagation, leaf rules and per-submodule traces."""

    def __init__(self, leaves: Iterable = (), flatten: bool = False, prefix: str = "",
                 rel: str = "", fake_mode=None):
        super().__init__()
        self.proxy_buffer_attributes = True  # buffers sliced by traced sizes (GPT-Neo's mask)
        self.leaves = tuple(leaves)
        self.flatten = flatten
        self.prefix = prefix      # schedule path of the traced module (for messages)
        self.rel = rel            # path of the traced module below the node trace() ran on
        self.fake_mode = fake_mode
        self.children: dict[str, tuple] = {}  # path -> (GraphModule, input names, output)
        self._computing_meta = False

    # -- leaves ---------------------------------------------------------------------
    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if state.is_leaf(m) or has_foreign_hooks(m):
            return True
        if type(m).__name__ == "OptimizedModule" or isinstance(m, torch.jit.ScriptModule):
            return True  # compiled (torch.compile's wrapper, TorchScript): one call
        rel = f"{self.rel}.{qualname}" if self.rel and qualname else (self.rel or qualname)
        for leaf in self.leaves:
            if isinstance(leaf, type):
                if isinstance(m, leaf):
                    return True
            elif isinstance(leaf, str):
                if fnmatch.fnmatchcase(rel, leaf) or type(m).__name__ == leaf:
                    return True
            else:
                raise TypeError(f"leaves holds {leaf!r}; expected module classes or paths")
        if isinstance(m, fx.GraphModule):
            return False
        return super().is_leaf_module(m, qualname)

    # -- module calls ---------------------------------------------------------------
    def call_module(self, m: nn.Module, forward: Callable, args: tuple, kwargs: dict) -> Any:
        if self._computing_meta:
            return forward(*args, **kwargs)
        try:
            path = self.path_of_module(m)
        except NameError:
            if not _stateless(m):
                raise
            return forward(*args, **kwargs)  # a stateless module made on the fly: inline it
        try:
            if self.flatten or self.is_leaf_module(m, path) or _stateless(m):
                state.set_untraced_reason(m, None)  # whole by choice: drop an earlier mark
                return super().call_module(m, forward, args, kwargs)
            return self._call_child(m, path, args, kwargs)
        except Exception as err:
            if state.error_where(err) is None and not getattr(err, "path", ""):
                state.set_error_where(err, self._full(path), type(m).__name__)
            raise

    def _call_child(self, m: nn.Module, path: str, args: tuple, kwargs: dict):
        """flatten=False: a non-leaf submodule is traced on its own, right here (its inputs'
        example values are known now), and called as its GraphModule."""
        adapter = adapter_of(m)
        if adapter is not None:  # already traced: map the call onto its graph inputs
            args, kwargs = adapter.map_call(args, kwargs)
        plan = plan_for_call(m, args, kwargs)
        if path in self.children:
            if self.children[path][1] != [s.name for s in plan.slots]:
                raise TraceError(f"'{self._full(path)}' is called twice with different traced "
                                 "arguments; trace with flatten=True or make it a leaf")
            out_meta = self.children[path][2]
        else:
            rel = ".".join(p for p in (self.rel, path) if p)
            # The nested trace patches module calls and attributes for itself; building its
            # GraphModule afterwards must see real attributes, not this trace's proxies.
            try:
                with self._real_values():
                    sub, out_meta = _trace_graph_module(m, plan, self.leaves, self.flatten,
                                                        self._full(path), rel, self.fake_mode)
            except Exception as err:
                # As upstream Slapo's tracer: a submodule that cannot be traced stays whole,
                # one call in its parent's graph; only the module trace() ran on must trace.
                reason = str(_trace_error(err, self._full(path), m))
                state.set_untraced_reason(m, reason)
                warnings.warn(f"trace kept '{self._full(path)}' ({type(m).__name__}) whole, as "
                              f"one call: {reason}", stacklevel=2)
                return self.create_proxy("call_module", path, args, kwargs)
            self.children[path] = (sub, [s.name for s in plan.slots], out_meta)
        inputs = [self._slot_value(plan, slot, args, kwargs) for slot in plan.slots]
        self._known_meta = out_meta
        try:
            return self.create_proxy("call_module", path, tuple(inputs), {})
        finally:
            del self._known_meta

    @staticmethod
    def _slot_value(plan: CallPlan, slot: Slot, args, kwargs):
        bound = plan.signature.bind(*args, **kwargs).arguments
        value = bound[slot.param]
        return value if slot.key is None else value[slot.key]

    def _full(self, path: str) -> str:
        return ".".join(p for p in (self.prefix, path) if p)

    # -- attributes -----------------------------------------------------------------
    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict) -> Any:
        if self._computing_meta:
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def create_node(self, kind, target, args, kwargs, name=None, type_expr=None):
        if kind == "get_attr":
            target = self._attr_alias(target)
        if name is None and kind in ("call_module", "get_attr") and \
                self.graph._target_to_str(target) == "self":
            name = "self_module"  # a node named "self" would shadow the generated forward's self
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        if kind == "get_attr":
            node.meta[META] = self._attr_value(node.target)
        return node

    def _attr_alias(self, target: str) -> str:
        # A module may expose a parameter under another attribute name than the one it is
        # registered under (DecomposedLinear's bias); the graph must read the alias.
        owner_path, _, attr = target.rpartition(".")
        try:
            owner = self.root.get_submodule(owner_path)
        except AttributeError:
            return target
        alias = state.attr_alias(owner, attr)
        return f"{owner_path}.{alias}" if alias and owner_path else alias or target

    def create_arg(self, a: Any):
        # transformers' ModelOutput is a dataclass *and* a dict: rebuild it as its own class
        # (fx would turn it into a plain dict), keeping only the fields that are set.
        if is_dataclass(a) and isinstance(a, dict) and not isinstance(a, type):
            values = {f.name: getattr(a, f.name) for f in fields(a)
                      if getattr(a, f.name) is not None}
            node = self.create_node("call_function", type(a), (),
                                    {k: self.create_arg(v) for k, v in values.items()})
            try:
                node.meta[META] = type(a)(**map_aggregate(values, meta_of))
            except Exception:
                node.meta[META] = UNKNOWN
            return node
        try:
            return super().create_arg(a)
        except NotImplementedError:
            hint = " (for a transformers cache: concrete_args={'use_cache': False})" \
                if "Cache" in type(a).__name__ else ""
            raise TraceError(f"a {type(a).__name__} object flows into the graph, which holds "
                             "only tensors and plain values; fix the argument that creates it "
                             f"with concrete_args{hint}") from None

    # -- proxies with example values --------------------------------------------------
    def proxy(self, node: fx.Node) -> MetaProxy:
        return MetaProxy(node, self)

    def create_proxy(self, kind, target, args, kwargs, name=None, type_expr=None,
                     proxy_factory_fn=None):
        proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr,
                                     proxy_factory_fn)
        node = proxy.node
        if kind in ("call_function", "call_method"):
            def run(a, k):
                if kind == "call_function":
                    return target(*a, **k)
                return getattr(a[0], target)(*a[1:], **k)
            node.meta[META] = self._run_meta(run, args, kwargs)
        elif kind == "call_module" and "_known_meta" in self.__dict__:
            node.meta[META] = self._known_meta
        elif kind == "call_module":
            mod = self.root.get_submodule(target)
            node.meta[META] = self._run_meta(lambda a, k: mod(*a, **k), args, kwargs)
        return proxy

    @contextlib.contextmanager
    def _real_values(self):
        """Module calls and attributes behave as without tracing (for example values)."""
        saved, self._computing_meta = self._computing_meta, True
        try:
            yield
        finally:
            self._computing_meta = saved

    def _attr_value(self, target: str) -> Any:
        value = self.root
        with self._real_values():
            try:
                for atom in target.split("."):
                    value = getattr(value, atom)
                return value
            except AttributeError:
                return UNKNOWN

    def _run_meta(self, fn: Callable, args, kwargs) -> Any:
        if self.fake_mode is None:
            return UNKNOWN
        try:
            margs = map_aggregate(args, to_meta)
            mkwargs = map_aggregate(kwargs, to_meta)
        except UnknownMeta:
            return UNKNOWN
        try:
            with self._real_values(), self.fake_mode:
                return fn(margs, mkwargs)
        except Exception:
            return UNKNOWN

    # -- control flow on traced values -------------------------------------------------
    def to_bool(self, obj: fx.Proxy) -> bool:
        meta = meta_of(obj)
        if isinstance(meta, torch.Tensor):
            raise TraceError(f"control flow depends on the data of '{obj.node.name}'; make "
                             "the module a leaf or pass that argument in concrete_args")
        if meta is UNKNOWN:
            raise TraceError(f"control flow depends on the traced value '{obj.node.name}', "
                             "whose example value is unknown; pass example_inputs (or fix the "
                             "argument with concrete_args)")
        return bool(meta)

    def iter(self, obj: fx.Proxy):
        meta = meta_of(obj)
        if meta is UNKNOWN or not hasattr(meta, "__len__"):
            raise TraceError(f"iterating over the traced value '{obj.node.name}' needs its "
                             "example value; pass example_inputs to trace")
        return iter([obj[i] for i in range(len(meta))])

    def keys(self, obj: fx.Proxy):
        meta = meta_of(obj)
        if hasattr(meta, "keys"):
            return list(meta.keys())
        return super().keys(obj)

    # -- the root function ------------------------------------------------------------
    def trace_plan(self, root: nn.Module, plan: CallPlan) -> fx.Graph:
        self._plan = plan
        # Example values are computed on the device of the module's parameters (a model made
        # on the meta device by init_empty_weights, or on a GPU, where the example inputs made
        # from a config are CPU tensors): inputs elsewhere would not meet its parameters.
        devices = {p.device for p in root.parameters()}
        self._example_device = devices.pop() if len(devices) == 1 else None
        with _PatchConstructors():
            return self.trace(root)

    def create_args_for_root(self, root_fn, is_module, concrete_args=None):
        plan = self._plan
        placeholders = []
        for slot, meta in zip(plan.slots, plan.slot_meta, strict=True):
            proxy = self.create_proxy("placeholder", slot.name, (), {})
            proxy.node.meta[META] = self._fake(meta)
            placeholders.append(proxy)

        def root(mod, *inputs):
            args, kwargs = plan.arguments(inputs)
            return root_fn(mod, *args, **kwargs)

        return root, [self.root, *placeholders]

    def _fake(self, value: Any) -> Any:
        if value is UNKNOWN:
            return UNKNOWN
        if isinstance(value, fx.Proxy):
            return meta_of(value)

        def convert(v):
            if isinstance(v, fx.Proxy):
                return meta_of(v)
            if isinstance(v, torch.Tensor) and self.fake_mode is not None and \
                    not isinstance(v, torch._subclasses.FakeTensor):
                device = self._example_device
                return self.fake_mode.from_tensor(v if device is None else v.to(device))
            return v
        return pytree.tree_map(convert, value, is_leaf=lambda v: isinstance(v, fx.Proxy))


# --- entry points -----------------------------------------------------------------------
def trace_module(mod: nn.Module, *, example_inputs=None, concrete_args: dict | None = None,
                 leaves: Iterable = (), flatten: bool = False, path: str = "") -> fx.GraphModule:
    """Trace ``mod`` into a GraphModule (see ``slapo.tracing``); ``path`` is used in
    messages. The result carries a pre-hook accepting ``mod``'s call signature."""
    if isinstance(leaves, (type, str)):
        leaves = (leaves,)
    leaves = tuple(leaves)
    plan = plan_for_root(mod, example_inputs, concrete_args)
    fake_mode = None
    if example_inputs is not None:
        from torch._subclasses.fake_tensor import FakeTensorMode
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    gm, _ = _trace_graph_module(mod, plan, leaves, flatten, path, "", fake_mode)
    gm.meta[_FLATTENED] = flatten
    for sub in gm.modules():  # a proxy kept as an attribute would be a tracer bug
        for value in [*sub._parameters.values(), *sub._buffers.values(), *sub.__dict__.values()]:
            if isinstance(value, fx.Proxy):
                raise RuntimeError(f"internal error: tracing '{path or '<root>'}' left a proxy "
                                   f"in {type(sub).__name__}")
    gm.register_forward_pre_hook(CallAdapter(plan, path or "<root>", mod.training),
                                 with_kwargs=True)
    return gm


def _trace_graph_module(mod, plan, leaves, flatten, path, rel, fake_mode):
    """``mod`` traced with ``plan`` (submodules first, when they are called), and the example
    value of its output."""
    tracer = SlapoTracer(leaves, flatten, prefix=path, rel=rel, fake_mode=fake_mode)
    try:
        graph = tracer.trace_plan(mod, plan)
    except Exception as err:
        raise _trace_error(err, path, mod) from err
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    out_meta = fx.node.map_arg(output.args[0], lambda n: n.meta.get(META, UNKNOWN))
    gm = fx.GraphModule(tracer.root, graph, class_name=type(mod).__name__)
    for child_path, (sub, _, _) in tracer.children.items():
        gm.set_submodule(child_path, sub)
    _finish(gm, mod)
    return gm, out_meta


def _trace_error(err: Exception, path: str, mod: nn.Module) -> TraceError:
    if isinstance(err, TraceError) and err.path:
        return err  # already explained by the trace of a submodule
    where, cls = state.error_where(err) or (path, type(mod).__name__)
    where = where or "<root>"
    reason = f"{type(err).__name__}: {err}"
    hint = ("; make that module a leaf (trace(leaves=[...])), fix the argument that drives the "
            "control flow (concrete_args), or pass example_inputs")
    return TraceError(f"cannot trace '{where}' ({cls}): {reason}{hint}", where, cls)


def _finish(gm: fx.GraphModule, mod: nn.Module) -> None:
    """Drop example values (keeping their kind, and a tuple's item kinds), keep plain
    attributes such as ``config``, and let dropout traced in train mode follow the mode."""
    # Every node's example value goes before dead code is removed: the graph's namespace keeps
    # its removed nodes, and a fake value there would keep the trace's FakeTensorMode alive,
    # whose weak references to the parameters forbid materialize's swap_tensors later.
    for node in gm.graph.nodes:
        meta = node.meta.pop(META, UNKNOWN)
        node.meta[KIND] = kind_of(meta)
        if (items := items_of(meta)) is not None:
            node.meta[ITEMS] = items
    gm.graph.eliminate_dead_code()
    _keep_alias_names(gm, mod)
    for name, value in mod.__dict__.items():
        if name.startswith("_") or name in gm.__dict__ or hasattr(type(gm), name):
            continue
        if isinstance(value, (torch.Tensor, nn.Module)):
            continue
        setattr(gm, name, value)
    if mod.training:  # after the attributes: a dropout module takes a name they leave free
        _dropout_follows_mode(gm)
    gm.recompile()
    gm.meta[_TRACED_FROM] = type(mod)
    gm.training = mod.training


# Functional dropout and the module that computes it in its own mode.
_DROPOUT_MODULES = {F.dropout: nn.Dropout, F.dropout1d: nn.Dropout1d, F.dropout2d: nn.Dropout2d,
                    F.dropout3d: nn.Dropout3d, F.alpha_dropout: nn.AlphaDropout,
                    F.feature_alpha_dropout: nn.FeatureAlphaDropout}
# Functions that take a dropout rate: its keyword and its position.
_DROPOUT_RATE = {F.scaled_dot_product_attention: ("dropout_p", 4)}


def dropout_rate(training: bool, p: float) -> float:
    """The rate of a traced dropout in the mode its graph runs in: ``p`` training, else 0."""
    return p if training else 0.0


def _dropout_follows_mode(gm: fx.GraphModule) -> None:
    """Let the dropout of a graph traced in train mode follow the mode it runs in, as the
    module it came from did. Code that computes the switch or the rate from ``self.training``
    (transformers' attention: ``dropout=0.0 if not self.training else p``) leaves a constant
    in the graph, which would keep dropping out after ``eval()``. So a functional dropout that
    is on becomes a call of its module (``F.dropout`` -> ``nn.Dropout``, the same draws; a
    pattern's ``F.dropout`` matches it), and a rate given to another function (attention's
    ``dropout_p``) is read through ``dropout_rate(self.training, p)``. torch records the
    switch whether the code gave it or not, so a dropout written to stay on in eval mode
    follows the mode too."""
    graph = gm.graph
    mode = None
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in _DROPOUT_MODULES:
            p, on = _argument(node, "p", 1, 0.5), _argument(node, "training", 2, True)
            if on is True and isinstance(p, (int, float)) and node.args:
                name = _free_name(gm, node.name)
                gm.add_submodule(name, _DROPOUT_MODULES[node.target](
                    p, inplace=bool(_argument(node, "inplace", 3, False))))
                with graph.inserting_before(node):
                    call = graph.call_module(name, (node.args[0],))
                call.meta.update(node.meta)
                node.replace_all_uses_with(call)
                graph.erase_node(node)
        elif node.target in _DROPOUT_RATE:
            key, index = _DROPOUT_RATE[node.target]
            rate = _argument(node, key, index, 0.0)
            if isinstance(rate, (int, float)) and rate > 0:
                if mode is None:
                    first = next(n for n in graph.nodes if n.op != "placeholder")
                    with graph.inserting_before(first), warnings.catch_warnings():
                        # the mode is a plain attribute of the GraphModule, not a parameter
                        warnings.filterwarnings("ignore", message="Attempted to insert a get_attr")
                        mode = graph.get_attr("training")
                with graph.inserting_before(node):
                    gated = graph.call_function(dropout_rate, (mode, rate))
                _set_argument(node, key, index, gated)


def _free_name(gm: fx.GraphModule, name: str) -> str:
    candidate, i = name, 0
    while hasattr(gm, candidate):
        i += 1
        candidate = f"{name}_{i}"
    return candidate


def _argument(node: fx.Node, key: str, index: int, default):
    if key in node.kwargs:
        return node.kwargs[key]
    return node.args[index] if len(node.args) > index else default


def _set_argument(node: fx.Node, key: str, index: int, value) -> None:
    if key not in node.kwargs and len(node.args) > index:
        node.update_arg(index, value)
    else:
        node.update_kwarg(key, value)


def _keep_alias_names(gm: fx.GraphModule, mod: nn.Module) -> None:
    """Register again, under its original path, each parameter the graph uses under another
    name (a bias shared by a head and its decoder), so that parameter names do not change."""
    used = {id(p) for p in gm.parameters()}
    for path, param in mod.named_parameters(remove_duplicate=False):
        if id(param) not in used:
            continue
        owner_path, _, field = path.rpartition(".")
        try:
            owner = gm.get_submodule(owner_path)
        except AttributeError:
            continue
        if field not in owner._parameters:
            owner.register_parameter(field, param)


def is_flattened(mod: nn.Module) -> bool:
    """Whether ``mod`` is a GraphModule that slapo's trace made with ``flatten=True``: its
    graph calls its submodules' leaves directly, not the submodules."""
    return is_traced(mod) and bool(mod.meta.get(_FLATTENED))


def is_traced(mod: nn.Module) -> bool:
    """Whether ``mod`` is a GraphModule produced by slapo's trace."""
    return isinstance(mod, fx.GraphModule) and _TRACED_FROM in getattr(mod, "meta", {})

