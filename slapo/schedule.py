"""The schedule tree: one node per submodule, mirroring the module hierarchy.

A schedule never copies the model. Each node holds the module it schedules, its dotted path
from the root, the process group the model is parallelised over, and its children. Primitives
(``slapo.list_primitives()``) are looked up by name on any node, so a schedule reads like the
model: ``sch["encoder.layer.0.attention.self.query"].shard("weight", axis=0)``.
"""

from __future__ import annotations

import difflib
import types
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import nn

from . import state
from .primitives import get_primitive
from .primitives.base import metadata_makers
from .primitives.shard import shard_spec
from .sharding import world_size
from .tracing import is_flattened


@dataclass(frozen=True)
class ScheduleMetadata:
    """Upstream Slapo's ``sch.metadata``, in its shape, read from the state slapo keeps.

    Attributes:
        tie_weights: every parameter the model holds in more than one place, mapped to
            itself (upstream maps the parameter before sharding to the one after; here the
            sharded parameter replaces the original everywhere, so both are the same). The
            same for every node: the analysis is the whole model's.
        primitives: by primitive name, as upstream: ``"shard"``, this module's own sharded
            parameters to their axis; ``"cut_pipeline_stage"``, the paths of the modules
            whose children end a pipeline stage (upstream's cutting levels), this node's and
            those below it, to True, in cut order. A primitive registered in upstream's class
            form (``slapo.primitives.base.Primitive``) with an ``init_metadata()`` has its
            entry here too: made at this node's first read, kept by the node, and the
            primitive's own to write.

        param_tags: the annotation keys (``annotate``) on the parameters of this module and
            those below it.

    A snapshot, read-only (but for those entries): the primitives change the state, not
    this view.
    """
    tie_weights: Mapping[nn.Parameter, nn.Parameter]
    primitives: Mapping[str, Mapping[str, Any]]
    param_tags: frozenset[str] = frozenset()


class Schedule:
    """A node of the schedule tree.

    Attributes:
        mod: the ``nn.Module`` this node schedules (changes when ``replace`` swaps it).
        name: the attribute name of ``mod`` in its parent ("" for the root).
        path: the dotted path from the root ("" for the root).
        parent: the parent node, or None for the root.
        group: the process group the model is parallelised over (None: the default group, or
            no group when ``torch.distributed`` is not initialised).
        child: the children, by attribute name, in module order.
    """

    def __init__(self, mod: nn.Module, name: str = "", parent: Schedule | None = None,
                 group: dist.ProcessGroup | None = None):
        self.mod = mod
        self.name = name
        self.parent = parent
        self.group = group
        self.path = f"{parent.path}.{name}" if parent is not None and parent.path else name
        self.child: dict[str, Schedule] = {}
        self._param_owners = None
        self._primitive_metadata: dict = {}  # entries of primitives registered as classes
        self._rebuild_children()

    def _rebuild_children(self) -> None:
        """(Re)create the child nodes from the current module's children. The children of a
        graph that ``trace(flatten=True)`` made get no children of their own: the graph calls
        the modules inside them directly, so scheduling those through the tree is refused
        (as upstream Slapo refuses it); ``get_module`` still reaches them."""
        self.child = {name: Schedule(sub, name, self, self.group)
                      for name, sub in self.mod.named_children()}
        if is_flattened(self.mod):
            for child in self.child.values():
                child.child = {}
        self.root._param_owners = None  # the module structure may have changed

    def param_owners(self, param) -> list[tuple[nn.Module, str]]:
        """Every (module, attribute name) in the model that holds ``param`` (tied weights
        appear more than once). Indexed once per model structure."""
        root = self.root
        if root._param_owners is None:
            owners: dict[int, list] = {}
            for module in root.mod.modules():
                for pname, p in module._parameters.items():
                    if p is not None:
                        owners.setdefault(id(p), []).append((module, pname))
            root._param_owners = owners
        return root._param_owners.get(id(param), [])

    def _replace_param_everywhere(self, old, new) -> list[tuple[nn.Module, str]]:
        """Swap every reference to parameter ``old`` for ``new``; returns the holders."""
        holders = self.param_owners(old)
        for module, pname in holders:
            module._parameters[pname] = new
        index = self.root._param_owners
        index[id(new)] = index.pop(id(old))
        return holders

    # --- where this node is -------------------------------------------------------------

    @property
    def root(self) -> Schedule:
        node = self
        while node.parent is not None:
            node = node.parent
        return node

    def get_top_schedule(self) -> Schedule:
        """The root node (upstream Slapo's name for ``root``)."""
        return self.root

    @property
    def world_size(self) -> int:
        return world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group) if dist.is_initialized() else 0

    @property
    def metadata(self) -> ScheduleMetadata:
        """Upstream Slapo's metadata of this node (``ScheduleMetadata``), computed from the
        model and the schedule's state each time it is read."""
        root = self.root
        tied = OrderedDict()
        for module in root.mod.modules():
            for param in module._parameters.values():
                if param is not None and len(self.param_owners(param)) > 1:
                    tied[param] = param
        shard = OrderedDict((name, spec.axis) for name, param in self.mod._parameters.items()
                            if param is not None and (spec := shard_spec(param)) is not None)
        levels = OrderedDict()
        for cut in state.pipeline_cuts(root):
            level = cut.rpartition(".")[0]
            if not self.path or level == self.path or level.startswith(self.path + "."):
                levels[level] = True
        primitives = {"shard": types.MappingProxyType(shard),
                      "cut_pipeline_stage": types.MappingProxyType(levels)}
        for name, make in metadata_makers().items():  # upstream's class form: theirs to write
            if name not in self._primitive_metadata:
                self._primitive_metadata[name] = make()
            if self._primitive_metadata[name] is not None:
                primitives[name] = self._primitive_metadata[name]
        tags = frozenset(key for param in self.mod.parameters()
                         for key in getattr(param, "slapo_annotations", {}))
        return ScheduleMetadata(types.MappingProxyType(tied),
                                types.MappingProxyType(primitives), tags)

    # --- lookup -------------------------------------------------------------------------
    def __getitem__(self, path: str) -> Schedule:
        """The node at ``path`` relative to this one (ModuleList indices are path parts)."""
        node = self
        for part in path.split(".") if path else []:
            if part not in node.child:
                full = f"{self.path}.{path}" if self.path else path
                if node.parent is not None and is_flattened(node.parent.mod) and \
                        hasattr(node.mod, part):
                    owner, rel = node.parent.path, full[len(node.parent.path):].lstrip(".")
                    raise KeyError(f"'{full}' is inside the graph that trace(flatten=True) "
                                   f"made of '{owner or '<root>'}', which calls its modules "
                                   f"directly ('{rel}'), so it has no schedule: reach it with "
                                   f"get_module('{rel}') on the schedule of "
                                   f"'{owner or '<root>'}', schedule it before tracing, or "
                                   "trace with flatten=False")
                if part in dict(node.mod.named_parameters(recurse=False)):
                    raise KeyError(f"'{full}' is a parameter, not a submodule: use "
                                   f"sch['{node.path}'] and pass '{part}' to the primitive")
                close = difflib.get_close_matches(full, [p for p, _ in self.root.named_schedules()],
                                                  n=3, cutoff=0.5)
                if not close:
                    close = [f"{node.path}.{c}" if node.path else c for c in node.child]
                hint = f"; closest existing paths: {', '.join(close)}" if close else ""
                raise KeyError(f"no submodule '{full}' in {type(self.root.mod).__name__}{hint}")
            node = node.child[part]
        return node

    def get_module(self, path: str) -> nn.Module:
        """The module at ``path`` relative to this node (upstream Slapo's spelling):
        ``sch[path].mod``, or a module inside a graph ``trace(flatten=True)`` made, which
        has no schedule node of its own."""
        try:
            return self[path].mod
        except KeyError:
            try:
                return self.mod.get_submodule(path)
            except AttributeError:
                pass
            raise

    def __contains__(self, path: str) -> bool:
        try:
            self[path]
        except KeyError:
            return False
        return True

    def named_schedules(self) -> Iterator[tuple[str, Schedule]]:
        """Every node below and including this one, as (path, node), in module order."""
        yield self.path, self
        for sub in self.child.values():
            yield from sub.named_schedules()

    # --- primitives ---------------------------------------------------------------------
    def __getattr__(self, name: str):
        # Only reached when normal attribute lookup fails: resolve primitives by name.
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            primitive = get_primitive(name)
        except KeyError as err:
            raise AttributeError(f"Schedule has no attribute or primitive '{name}'") from err
        return types.MethodType(primitive, self)

    def __dir__(self):
        from .primitives import list_primitives
        return sorted(set(super().__dir__()) | set(list_primitives()))

    def __repr__(self) -> str:
        return (f"Schedule(path='{self.path}', mod={type(self.mod).__name__}, "
                f"world_size={self.world_size})")


def create_schedule(model: nn.Module, group: dist.ProcessGroup | None = None) -> Schedule:
    """Create the schedule tree of ``model`` for parallelisation over ``group``.

    With ``group=None`` the default process group is used when ``torch.distributed`` is
    initialised; otherwise the schedule has world size 1 and sharding primitives are no-ops
    that still validate their arguments.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"create_schedule expects an nn.Module, got {type(model).__name__}")
    return Schedule(model, group=group)
