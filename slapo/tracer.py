"""Tracing a module into a ``torch.fx`` GraphModule that keeps the module hierarchy.

``trace_module`` is what the ``trace`` primitive runs. It is ``torch.fx`` symbolic tracing with
three additions that HF transformer blocks need (transformers 5.x no longer ships its fx
tracer):

- Shape metadata. With ``example_inputs``, every value carries a fake tensor (or a Python
  value such as a ``torch.Size``) computed under ``FakeTensorMode``. ``len(x.shape)``,
  ``(*x.shape[:-1], -1, d)`` and ``if x.dim() == 4`` then work, while the sizes themselves
  stay graph values (``view(x.size(0), ...)``), so the graph still accepts other batch sizes
  and sequence lengths. Python control flow on a traced value is decided by its example value
  (the graph is specialised to that branch); data-dependent control flow is an error.
- Arguments. The graph's inputs are the arguments given in ``example_inputs`` (or, without
  them, the arguments that have no default); every other argument is fixed to its value in
  ``concrete_args`` or to its default. A traced module keeps a forward pre-hook that accepts
  the original call signature, passes the graph inputs on, and raises a clear error when a
  fixed argument arrives with another value than it was traced with.
- Hierarchy. With ``flatten=False`` each submodule that is not a leaf is traced on its own
  into a GraphModule at the same path, so the schedule tree keeps every level (paths such as
  ``encoder.layer.0.attention`` still exist); stateless ones (no parameters or buffers, such
  as HF activation modules) are traced into their caller's graph, where patterns can see
  them. With ``flatten=True`` the graph calls only leaf modules. Leaves are ``torch.nn``
  modules (as in fx), the classes/paths in ``leaves``, modules that primitives have already
  changed (hooks, a replaced forward, for example ``checkpoint`` or ``sync``), and slapo's own
  fused/decomposed modules.

Errors name the module that failed (path and class), with the reason from fx.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import inspect
import warnings
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Callable, Iterable

import torch
import torch.fx as fx
from torch import nn
from torch.fx.node import map_aggregate
from torch.fx.proxy import Attribute
from torch.utils import _pytree as pytree

__all__ = ["TraceError", "trace_module", "is_traced", "traced_signature"]

_META = "slapo_meta"        # node.meta key holding the example value while tracing
KIND = "slapo_kind"         # node.meta key kept after tracing: "tensor", "none", a type name
_UNKNOWN = object()         # no example value known for a node

# torch constructors that take no tensor argument: patched while tracing so that a traced
# size or device (``torch.arange(seq_len, device=x.device)``) becomes a graph node.
_CONSTRUCTORS = ("arange", "zeros", "ones", "full", "empty", "tensor", "eye", "rand", "randn",
                 "randint", "linspace")


class TraceError(fx.proxy.TraceError):
    """A module could not be traced. ``path`` and ``module_class`` name the module that failed
    (the innermost one being traced when the error happened)."""

    def __init__(self, message: str, path: str = "", module_class: str = ""):
        super().__init__(message)
        self.path = path
        self.module_class = module_class


# --- values with example metadata -------------------------------------------------------
def _meta_of(value: Any) -> Any:
    """The example value of a proxy (or _UNKNOWN); non-proxies are their own example."""
    if isinstance(value, Attribute) and value._node is None:
        root = _meta_of(value.root)
        if root is _UNKNOWN:
            return _UNKNOWN
        try:
            return getattr(root, value.attr)
        except Exception:
            return _UNKNOWN
    if isinstance(value, fx.Proxy):
        return value.node.meta.get(_META, _UNKNOWN)
    return value


class _Unknown(Exception):
    pass


def _to_meta(value: Any) -> Any:
    meta = _meta_of(value)
    if meta is _UNKNOWN:
        raise _Unknown
    return meta


def _contains_proxy(value: Any) -> bool:
    found = []
    map_aggregate(value, lambda v: found.append(v) if isinstance(v, fx.Proxy) else None)
    return bool(found)


def _kind_of(meta: Any) -> str:
    if meta is _UNKNOWN:
        return "unknown"
    if isinstance(meta, torch.Tensor):
        return "tensor"
    if meta is None:
        return "none"
    return type(meta).__name__


class MetaProxy(fx.Proxy):
    """A proxy that knows its example value: ``len``, iteration and ``bool`` use it, and the
    ``dtype`` and rank of a tensor are read from it (sizes stay graph values)."""

    def __getattr__(self, name: str):
        meta = _meta_of(self)
        if meta is not _UNKNOWN and not isinstance(meta, torch.Tensor):
            try:
                if getattr(meta, name) is None:
                    return None  # e.g. an unset field of a ModelOutput: None, not a graph value
            except Exception:
                pass
        return MetaAttribute(self, name)

    def __len__(self) -> int:
        meta = _meta_of(self)
        try:
            return len(meta)
        except TypeError:
            raise TraceError(f"len() of the traced value '{self.node.name}' needs its example "
                             "value; pass example_inputs to trace") from None

    @property
    def dtype(self):
        meta = _meta_of(self)
        if isinstance(meta, torch.Tensor):
            return meta.dtype
        return MetaAttribute(self, "dtype")

    @property
    def ndim(self):
        meta = _meta_of(self)
        if isinstance(meta, torch.Tensor):
            return meta.dim()
        return MetaAttribute(self, "ndim")

    def dim(self):
        meta = _meta_of(self)
        if isinstance(meta, torch.Tensor):
            return meta.dim()
        return self.tracer.create_proxy("call_method", "dim", (self,), {})


class MetaAttribute(Attribute, MetaProxy):
    """An attribute of a traced value (``x.shape``, ``x.device``), a node once it is used."""


# --- the call plan: which arguments are graph inputs, which are fixed -------------------
@dataclass
class _Slot:
    """One graph input: argument ``param`` (for ``**kwargs``: its entry ``key``)."""
    param: str
    key: str | int | None = None

    @property
    def name(self) -> str:
        if self.key is None:
            return self.param
        return f"{self.param}_{self.key}" if isinstance(self.key, int) else str(self.key)


@dataclass
class CallPlan:
    """How a traced module is called: the original signature, the graph inputs and the
    values the other arguments were fixed to while tracing."""
    signature: inspect.Signature            # without ``self``
    slots: list[_Slot] = field(default_factory=list)
    slot_meta: list[Any] = field(default_factory=list)
    fixed: dict[str, Any] = field(default_factory=dict)  # param -> value (``**kw``: a dict)

    def arguments(self, inputs: Iterable[Any]) -> tuple[tuple, dict]:
        """The (args, kwargs) of a call of the original forward with these graph inputs.
        Arguments are passed by keyword where the signature allows it (decorators of HF
        forwards add keywords of their own); arguments neither fixed nor inputs are left out."""
        values: dict[str, Any] = {}
        for name, value in self.fixed.items():
            kind = self._kind(name)
            values[name] = dict(value) if kind == inspect.Parameter.VAR_KEYWORD else \
                tuple(value) if kind == inspect.Parameter.VAR_POSITIONAL else value
        for slot, value in zip(self.slots, inputs):
            kind = self._kind(slot.param)
            if kind == inspect.Parameter.VAR_KEYWORD:
                values.setdefault(slot.param, {})[slot.key] = value
            elif kind == inspect.Parameter.VAR_POSITIONAL:
                items = list(values.get(slot.param, ()))
                items.insert(slot.key, value)
                values[slot.param] = tuple(items)
            else:
                values[slot.param] = value
        params = list(self.signature.parameters.values())
        var_pos = any(p.kind == p.VAR_POSITIONAL and values.get(p.name) for p in params)
        args: list[Any] = []
        kwargs: dict[str, Any] = {}
        for p in params:
            positional = p.kind == p.POSITIONAL_ONLY or \
                (var_pos and p.kind == p.POSITIONAL_OR_KEYWORD)
            if p.name not in values:
                if positional:
                    args.append(p.default)
                continue
            value = values[p.name]
            if p.kind == p.VAR_POSITIONAL:
                args.extend(value)
            elif p.kind == p.VAR_KEYWORD:
                kwargs.update(value)
            elif positional:
                args.append(value)
            else:
                kwargs[p.name] = value
        return tuple(args), kwargs

    def _kind(self, param: str):
        return self.signature.parameters[param].kind


def _forward_signature(mod: nn.Module) -> inspect.Signature:
    """The signature of ``mod``'s forward without ``self`` (through decorators' wrappers)."""
    sig = inspect.signature(type(mod).forward)
    return sig.replace(parameters=list(sig.parameters.values())[1:])


def _plan_for_root(mod: nn.Module, example_inputs, concrete_args) -> CallPlan:
    """Graph inputs of a module traced on its own: the example inputs (or, without them,
    the arguments without defaults); all other arguments fixed."""
    sig = _forward_signature(mod)
    params = sig.parameters
    concrete = dict(concrete_args or {})
    var_kw = next((p.name for p in params.values() if p.kind == p.VAR_KEYWORD), None)
    for name in concrete:
        if name not in params and var_kw is None:
            raise TypeError(f"concrete_args names '{name}', which {type(mod).__name__}.forward "
                            f"does not take; its arguments: {', '.join(params)}")
    inputs: dict[str, Any] = {}
    if isinstance(example_inputs, dict):
        inputs = dict(example_inputs)
    elif example_inputs is not None:
        if isinstance(example_inputs, torch.Tensor):
            example_inputs = (example_inputs,)
        positional = [p.name for p in params.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if len(example_inputs) > len(positional):
            raise TypeError(f"{len(example_inputs)} example inputs for "
                            f"{type(mod).__name__}.forward, which takes {len(positional)} "
                            "positional arguments; pass a dict of named inputs")
        inputs = dict(zip(positional, example_inputs))
    for name in inputs:
        if name not in params and var_kw is None:
            raise TypeError(f"example_inputs names '{name}', which {type(mod).__name__}.forward "
                            f"does not take; its arguments: {', '.join(params)}")
        if name in concrete:
            raise TypeError(f"argument '{name}' is both in example_inputs and concrete_args")

    plan = CallPlan(sig)
    for p in params.values():
        if p.kind == p.VAR_KEYWORD:
            extra = {k: v for k, v in {**inputs, **concrete}.items() if k not in params}
            fixed = {}
            for key, value in extra.items():
                if key in inputs and _has_tensor(value):
                    plan.slots.append(_Slot(p.name, key))
                    plan.slot_meta.append(value)
                else:
                    fixed[key] = value
            plan.fixed[p.name] = fixed
        elif p.kind == p.VAR_POSITIONAL:
            plan.fixed[p.name] = ()
        elif p.name in concrete:
            plan.fixed[p.name] = concrete[p.name]
        elif p.name in inputs:
            if _has_tensor(inputs[p.name]):
                plan.slots.append(_Slot(p.name))
                plan.slot_meta.append(inputs[p.name])
            else:
                plan.fixed[p.name] = inputs[p.name]
        elif example_inputs is None and p.default is p.empty:
            plan.slots.append(_Slot(p.name))
            plan.slot_meta.append(_UNKNOWN)
        elif p.default is not p.empty:
            continue  # left out of the call: the forward uses its default
        else:
            raise TypeError(f"argument '{p.name}' of {type(mod).__name__}.forward has no "
                            "default: give it in example_inputs or concrete_args")
    return plan


def _plan_for_call(mod: nn.Module, args: tuple, kwargs: dict) -> CallPlan:
    """Graph inputs of a submodule traced where its parent calls it: the arguments that hold
    traced values; the others fixed to the values of this call."""
    sig = _forward_signature(mod)
    bound = sig.bind(*args, **kwargs)
    plan = CallPlan(sig)
    for name, value in bound.arguments.items():
        kind = sig.parameters[name].kind
        if kind == inspect.Parameter.VAR_KEYWORD:
            fixed = {}
            for key, item in value.items():
                if _contains_proxy(item):
                    plan.slots.append(_Slot(name, key))
                    plan.slot_meta.append(item)
                else:
                    fixed[key] = item
            plan.fixed[name] = fixed
        elif kind == inspect.Parameter.VAR_POSITIONAL:
            if _contains_proxy(value):
                for i, item in enumerate(value):
                    plan.slots.append(_Slot(name, i))
                    plan.slot_meta.append(item)
                plan.fixed[name] = ()
            else:
                plan.fixed[name] = value
        elif _contains_proxy(value):
            plan.slots.append(_Slot(name))
            plan.slot_meta.append(value)
        else:
            plan.fixed[name] = value
    return plan


def _stateless(m: nn.Module) -> bool:
    """No parameters or buffers (an activation function): traced into its caller's graph."""
    return next(m.parameters(), None) is None and next(m.buffers(), None) is None


def _has_tensor(value: Any) -> bool:
    return any(isinstance(v, torch.Tensor) for v in pytree.tree_leaves(value))


# --- the tracer -----------------------------------------------------------------------
def _constructor_wrapper(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def wrapper(*args, **kwargs):
        proxies = [v for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, fx.Proxy)]
        if proxies:
            return proxies[0].tracer.create_proxy("call_function", orig, args, kwargs)
        return orig(*args, **kwargs)
    wrapper._slapo_constructor = True
    return wrapper


class _PatchConstructors:
    def __enter__(self):
        self.saved = {}
        for name in _CONSTRUCTORS:
            orig = getattr(torch, name)
            if not getattr(orig, "_slapo_constructor", False):
                self.saved[name] = orig
                setattr(torch, name, _constructor_wrapper(orig))
        return self

    def __exit__(self, *exc):
        for name, orig in self.saved.items():
            setattr(torch, name, orig)


def _is_adapter(hook) -> bool:
    return isinstance(hook, _CallAdapter)


# Hooks that do nothing unless their library asks for it, and that tracing may drop:
# transformers installs them to collect attentions/hidden states on request.
_INERT_HOOK_MODULES = ("transformers.utils.output_capturing",)


def _inert(hook) -> bool:
    return _is_adapter(hook) or getattr(hook, "__module__", "").startswith(_INERT_HOOK_MODULES)


def has_foreign_hooks(mod: nn.Module) -> bool:
    """Hooks from primitives or users (not slapo's call adapter, not transformers' output
    capturing), or a forward patched on the instance."""
    hooks = [*mod._forward_pre_hooks.values(), *mod._forward_hooks.values(),
             *mod._backward_hooks.values(), *mod._backward_pre_hooks.values()]
    return "forward" in mod.__dict__ or any(not _inert(h) for h in hooks)


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
        if getattr(m, "_slapo_leaf", False) or has_foreign_hooks(m):
            return True
        if type(m).__name__ == "OptimizedModule":  # torch.compile's wrapper
            return True
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
                return super().call_module(m, forward, args, kwargs)
            return self._call_child(m, path, args, kwargs)
        except Exception as err:
            if not hasattr(err, "_slapo_where") and not getattr(err, "path", ""):
                err._slapo_where = (self._full(path), type(m).__name__)
            raise

    def _call_child(self, m: nn.Module, path: str, args: tuple, kwargs: dict):
        """flatten=False: a non-leaf submodule is traced on its own, right here (its inputs'
        example values are known now), and called as its GraphModule."""
        adapter = next((h for h in m._forward_pre_hooks.values() if _is_adapter(h)), None)
        if adapter is not None:  # already traced: map the call onto its graph inputs
            args, kwargs = adapter.map_call(args, kwargs)
        plan = _plan_for_call(m, args, kwargs)
        if path in self.children:
            if self.children[path][1] != [s.name for s in plan.slots]:
                raise TraceError(f"'{self._full(path)}' is called twice with different traced "
                                 "arguments; trace with flatten=True or make it a leaf")
            out_meta = self.children[path][2]
        else:
            rel = ".".join(p for p in (self.rel, path) if p)
            # The nested trace patches module calls and attributes for itself; building its
            # GraphModule afterwards must see real attributes, not this trace's proxies.
            with self._real_values():
                sub, out_meta = _trace_graph_module(m, plan, self.leaves, self.flatten,
                                                    self._full(path), rel, self.fake_mode)
            self.children[path] = (sub, [s.name for s in plan.slots], out_meta)
        inputs = [self._slot_value(plan, slot, args, kwargs) for slot in plan.slots]
        self._known_meta = out_meta
        try:
            return self.create_proxy("call_module", path, tuple(inputs), {})
        finally:
            del self._known_meta

    @staticmethod
    def _slot_value(plan: CallPlan, slot: _Slot, args, kwargs):
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
            node.meta[_META] = self._attr_value(node.target)
        return node

    def _attr_alias(self, target: str) -> str:
        # A module may expose a parameter under another attribute name than the one it is
        # registered under (DecomposedLinear's bias); the graph must read the alias.
        owner_path, _, attr = target.rpartition(".")
        try:
            owner = self.root.get_submodule(owner_path)
        except AttributeError:
            return target
        alias = getattr(owner, "_slapo_attr_alias", {}).get(attr)
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
                node.meta[_META] = type(a)(**map_aggregate(values, _meta_of))
            except Exception:
                node.meta[_META] = _UNKNOWN
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
            node.meta[_META] = self._run_meta(run, args, kwargs)
        elif kind == "call_module" and "_known_meta" in self.__dict__:
            node.meta[_META] = self._known_meta
        elif kind == "call_module":
            mod = self.root.get_submodule(target)
            node.meta[_META] = self._run_meta(lambda a, k: mod(*a, **k), args, kwargs)
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
                return _UNKNOWN

    def _run_meta(self, fn: Callable, args, kwargs) -> Any:
        if self.fake_mode is None:
            return _UNKNOWN
        try:
            margs = map_aggregate(args, _to_meta)
            mkwargs = map_aggregate(kwargs, _to_meta)
        except _Unknown:
            return _UNKNOWN
        try:
            with self._real_values(), self.fake_mode:
                return fn(margs, mkwargs)
        except Exception:
            return _UNKNOWN

    # -- control flow on traced values -------------------------------------------------
    def to_bool(self, obj: fx.Proxy) -> bool:
        meta = _meta_of(obj)
        if isinstance(meta, torch.Tensor):
            raise TraceError(f"control flow depends on the data of '{obj.node.name}'; make "
                             "the module a leaf or pass that argument in concrete_args")
        if meta is _UNKNOWN:
            raise TraceError(f"control flow depends on the traced value '{obj.node.name}', "
                             "whose example value is unknown; pass example_inputs (or fix the "
                             "argument with concrete_args)")
        return bool(meta)

    def iter(self, obj: fx.Proxy):
        meta = _meta_of(obj)
        if meta is _UNKNOWN or not hasattr(meta, "__len__"):
            raise TraceError(f"iterating over the traced value '{obj.node.name}' needs its "
                             "example value; pass example_inputs to trace")
        return iter([obj[i] for i in range(len(meta))])

    def keys(self, obj: fx.Proxy):
        meta = _meta_of(obj)
        if hasattr(meta, "keys"):
            return list(meta.keys())
        return super().keys(obj)

    # -- the root function ------------------------------------------------------------
    def trace_plan(self, root: nn.Module, plan: CallPlan) -> fx.Graph:
        self._plan = plan
        with _PatchConstructors():
            return self.trace(root)

    def create_args_for_root(self, root_fn, is_module, concrete_args=None):
        plan = self._plan
        placeholders = []
        for slot, meta in zip(plan.slots, plan.slot_meta):
            proxy = self.create_proxy("placeholder", slot.name, (), {})
            proxy.node.meta[_META] = self._fake(meta)
            placeholders.append(proxy)

        def root(mod, *inputs):
            args, kwargs = plan.arguments(inputs)
            return root_fn(mod, *args, **kwargs)

        return root, [self.root, *placeholders]

    def _fake(self, value: Any) -> Any:
        if value is _UNKNOWN:
            return _UNKNOWN
        if isinstance(value, fx.Proxy):
            return _meta_of(value)

        def convert(v):
            if isinstance(v, fx.Proxy):
                return _meta_of(v)
            if isinstance(v, torch.Tensor) and self.fake_mode is not None and \
                    not isinstance(v, torch._subclasses.FakeTensor):
                return self.fake_mode.from_tensor(v)
            return v
        return pytree.tree_map(convert, value, is_leaf=lambda v: isinstance(v, fx.Proxy))


# --- the call adapter kept on traced modules --------------------------------------------
_SIMPLE = (bool, int, float, str, torch.dtype, type(None))


class _CallAdapter:
    """Forward pre-hook of a traced module: accepts the original signature, returns the graph
    inputs, and checks that fixed arguments have the values they were traced with."""

    def __init__(self, plan: CallPlan, where: str, training: bool = True):
        self.training = training
        self.warned = False
        self.signature = plan.signature
        self.slots = plan.slots
        self.slot_is_tensor = [_has_tensor(m) if m is not _UNKNOWN else None
                               for m in plan.slot_meta]
        self.fixed = plan.fixed
        self.where = where

    def map_call(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as err:
            raise TypeError(f"traced '{self.where}': {err}") from None
        values = bound.arguments
        inputs = []
        for slot, is_tensor in zip(self.slots, self.slot_is_tensor):
            kind = self.signature.parameters[slot.param].kind
            if kind == inspect.Parameter.VAR_KEYWORD:
                value = values.get(slot.param, {}).get(slot.key)
            elif kind == inspect.Parameter.VAR_POSITIONAL:
                items = values.get(slot.param, ())
                value = items[slot.key] if slot.key < len(items) else None
            elif slot.param in values:
                value = values[slot.param]
            else:
                value = self.signature.parameters[slot.param].default
                value = None if value is inspect.Parameter.empty else value
            if is_tensor and value is None:
                raise ValueError(f"traced '{self.where}' takes a tensor for '{slot.name}' (a "
                                 "graph input) but was called with None; trace it again "
                                 "without that input")
            inputs.append(value)
        slot_params = {s.param for s in self.slots}
        for name, value in values.items():  # only what the caller passed explicitly
            param = self.signature.parameters[name]
            if param.kind == inspect.Parameter.VAR_KEYWORD:
                traced = self.fixed.get(name, {})
                taken = {s.key for s in self.slots if s.param == name}
                for key, item in value.items():
                    if key not in taken:
                        self._check(key, traced.get(key), item)
            elif param.kind == inspect.Parameter.VAR_POSITIONAL:
                if value and name not in slot_params:
                    raise ValueError(f"traced '{self.where}' was traced without extra "
                                     f"positional arguments; got {len(value)}")
            elif name not in slot_params:
                self._check(name, self.fixed.get(name, param.default), value)
        return tuple(inputs), {}

    def _check(self, name: str, traced: Any, value: Any) -> None:
        if traced is value:
            return
        if isinstance(value, fx.Proxy):
            raise TraceError(f"traced '{self.where}' has argument '{name}' fixed to "
                             f"{_short(traced)}; it cannot take a traced value now")
        if isinstance(traced, _SIMPLE) and isinstance(value, _SIMPLE):
            same = type(traced) is type(value) and traced == value
        else:
            same = (traced is None) == (value is None)
        if not same:
            raise ValueError(
                f"traced '{self.where}' has argument '{name}' fixed to {_short(traced)}; it "
                f"was called with {_short(value)}. Trace again with that value (concrete_args) "
                "or make it a graph input (example_inputs)")

    def __call__(self, module, args, kwargs):
        if module.training != self.training and not self.warned:
            self.warned = True
            warnings.warn(f"traced '{self.where}' was traced in {_mode(self.training)} mode and "
                          f"now runs in {_mode(module.training)} mode: code paths fixed while "
                          "tracing (such as the dropout rate HF attention passes on) keep the "
                          "traced mode; trace again in the mode you run", stacklevel=2)
        return self.map_call(args, kwargs)


def _mode(training: bool) -> str:
    return "train" if training else "eval"


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    text = repr(value)
    return text if len(text) < 60 else text[:57] + "..."


# --- entry points --------------------------------------------------------------------
def trace_module(mod: nn.Module, *, example_inputs=None, concrete_args: dict | None = None,
                 leaves: Iterable = (), flatten: bool = False, path: str = "") -> fx.GraphModule:
    """Trace ``mod`` into a GraphModule (see the module docstring); ``path`` is used in
    messages. The result carries a pre-hook accepting ``mod``'s call signature."""
    if isinstance(leaves, (type, str)):
        leaves = (leaves,)
    leaves = tuple(leaves)
    plan = _plan_for_root(mod, example_inputs, concrete_args)
    fake_mode = None
    if example_inputs is not None:
        from torch._subclasses.fake_tensor import FakeTensorMode
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    gm, _ = _trace_graph_module(mod, plan, leaves, flatten, path, "", fake_mode)
    for sub in gm.modules():  # a proxy kept as an attribute would be a tracer bug
        for value in [*sub._parameters.values(), *sub._buffers.values(), *sub.__dict__.values()]:
            if isinstance(value, fx.Proxy):
                raise RuntimeError(f"internal error: tracing '{path or '<root>'}' left a proxy "
                                   f"in {type(sub).__name__}")
    gm.register_forward_pre_hook(_CallAdapter(plan, path or "<root>", mod.training),
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
    out_meta = fx.node.map_arg(output.args[0], lambda n: n.meta.get(_META, _UNKNOWN))
    gm = fx.GraphModule(tracer.root, graph, class_name=type(mod).__name__)
    for child_path, (sub, _, _) in tracer.children.items():
        gm.set_submodule(child_path, sub)
    _finish(gm, mod)
    return gm, out_meta


def _trace_error(err: Exception, path: str, mod: nn.Module) -> TraceError:
    if isinstance(err, TraceError) and err.path:
        return err  # already explained by the trace of a submodule
    where, cls = getattr(err, "_slapo_where", (path, type(mod).__name__))
    where = where or "<root>"
    reason = f"{type(err).__name__}: {err}"
    hint = ("; make that module a leaf (trace(leaves=[...])), fix the argument that drives the "
            "control flow (concrete_args), or pass example_inputs")
    return TraceError(f"cannot trace '{where}' ({cls}): {reason}{hint}", where, cls)


def _finish(gm: fx.GraphModule, mod: nn.Module) -> None:
    """Drop example values (keeping their kind), keep plain attributes such as ``config``."""
    gm.graph.eliminate_dead_code()
    _keep_alias_names(gm, mod)
    for node in gm.graph.nodes:
        meta = node.meta.pop(_META, _UNKNOWN)
        node.meta[KIND] = _kind_of(meta)
    gm.recompile()
    for name, value in mod.__dict__.items():
        if name.startswith("_") or name in gm.__dict__ or hasattr(type(gm), name):
            continue
        if isinstance(value, (torch.Tensor, nn.Module)):
            continue
        setattr(gm, name, value)
    gm.meta["slapo_traced_from"] = type(mod)
    gm.training = mod.training


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


def is_traced(mod: nn.Module) -> bool:
    """Whether ``mod`` is a GraphModule produced by slapo's trace."""
    return isinstance(mod, fx.GraphModule) and "slapo_traced_from" in getattr(mod, "meta", {})


def traced_signature(mod: nn.Module) -> inspect.Signature | None:
    """The original call signature a traced module accepts (None if not traced)."""
    for hook in mod._forward_pre_hooks.values():
        if _is_adapter(hook):
            return hook.signature
    return None

