"""The primitive registry, where upstream Slapo kept it (``slapo.primitives.base``).

A primitive is registered by name and called on any schedule node as a method,
``sch.<name>(...)``. Two forms register one:

- a function ``f(sch, ...)``, registered under its name (``register_primitive(name)`` for
  another), the form this package's own primitives use;
- upstream's form, a ``Primitive`` subclass with static ``name()`` and ``apply(sch, ...)``,
  registered under ``name()``; ``apply`` is what ``sch.<name>(...)`` calls, and a non-None
  ``init_metadata()`` is this primitive's entry in each node's ``sch.metadata.primitives``
  (made at the node's first read and kept by the node, so ``apply`` can record in it).

``slapo.list_primitives()`` lists them; ``help(sch.shard)`` (or
``help(get_primitive("shard"))``) shows a primitive's documentation.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Callable

_REGISTERED: dict[str, object] = {}  # name -> what was registered (a function or a class)


class Primitive:
    """Upstream Slapo's base class of a primitive given as a class (see the module)."""

    @staticmethod
    def name() -> str:
        """The name the primitive is called by: ``sch.<name>(...)``."""
        raise NotImplementedError

    @staticmethod
    def apply(sch, *args, **kwargs):
        """Apply the primitive to the schedule node ``sch``."""
        raise NotImplementedError

    @staticmethod
    def is_verifiable() -> bool:
        """Upstream's flag for primitives its ``Verify`` checked; here ``slapo.Verify`` checks
        the whole block, whichever primitives it holds."""
        return False

    @staticmethod
    def init_metadata():
        """The primitive's entry in ``sch.metadata.primitives`` of each node (None: none)."""
        return None


def register_primitive(name: str | None = None):
    """Decorator registering a schedule primitive: a function ``f(sch, ...)`` under ``name``
    (default: its name), or a ``Primitive`` subclass under its ``name()``. A name registered
    twice is an error."""
    def wrap(obj):
        if isinstance(obj, type):
            if not issubclass(obj, Primitive):
                raise ValueError(f"register_primitive: class {obj.__name__} is not a subclass of "
                                 "slapo.primitives.base.Primitive")
            missing = [m for m in ("name", "apply")
                       if getattr(obj, m) is getattr(Primitive, m) and not (m == "name" and name)]
            if missing:
                raise ValueError(f"register_primitive: {obj.__name__} does not define "
                                 f"{' or '.join(f'{m}()' for m in missing)}")
            key = name or obj.name()
            if obj.apply.__doc__ is None:
                obj.apply.__doc__ = obj.__doc__
        else:
            key = name or obj.__name__
        if key in _REGISTERED:
            raise ValueError(f"primitive '{key}' is registered twice")
        _REGISTERED[key] = obj
        return obj
    return wrap


def keyword_aliases(**aliases: str):
    """Decorator letting a primitive take upstream Slapo's keyword for an argument named
    otherwise here (``keyword_aliases(tensor_name="param_names")``); giving both is an error."""
    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def call(*args, **kwargs):
            for upstream, here in aliases.items():
                if upstream in kwargs:
                    if here in kwargs:
                        raise TypeError(f"{fn.__name__}: {upstream}= and {here}= name the same "
                                        "argument; give one")
                    kwargs[here] = kwargs.pop(upstream)
            return fn(*args, **kwargs)
        return call
    return wrap


def get_primitive(name: str) -> Callable:
    """What ``sch.<name>(...)`` calls: the function, or a ``Primitive`` class's ``apply``."""
    if name not in _REGISTERED:
        close = difflib.get_close_matches(name, _REGISTERED, n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise KeyError(f"unknown primitive '{name}'{hint}")
    obj = _REGISTERED[name]
    return obj.apply if isinstance(obj, type) else obj


def list_primitives(name_only: bool = True) -> list[str] | dict[str, object]:
    """The names of all registered primitives, sorted; with ``name_only=False`` (upstream's
    spelling) a dict of each name to what was registered, a function or a ``Primitive``
    class."""
    return sorted(_REGISTERED) if name_only else {key: _REGISTERED[key] for key in
                                                  sorted(_REGISTERED)}


def metadata_makers() -> dict[str, Callable]:
    """``init_metadata`` of each primitive registered in upstream's class form that has one."""
    return {key: obj.init_metadata for key, obj in _REGISTERED.items()
            if isinstance(obj, type) and obj.init_metadata is not Primitive.init_metadata}
