"""annotate: attach metadata to a parameter."""

from __future__ import annotations

from . import register_primitive
from ._params import annotations, get_param


@register_primitive()
def annotate(sch, param_name: str, key: str, value) -> None:
    """Attach ``key = value`` to parameter ``param_name`` of this module.

    The metadata lives on the parameter (``slapo.get_annotations(param)``), is copied onto
    the new parameter when the parameter is sharded, and onto the same-named parameter of a
    module that replaces this one. Frameworks read it, for example to skip weight decay or to
    tell a data-parallel engine which parameters are replicated.

    Example::

        sch["encoder.layer.0.output.LayerNorm"].annotate("weight", "replicated", True)
    """
    annotations(get_param(sch, param_name))[key] = value
