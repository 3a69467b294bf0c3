"""annotate: attach metadata to a parameter."""

from __future__ import annotations

from . import register_primitive
from ._params import get_param, set_annotation


@register_primitive()
def annotate(sch, param_name: str, key: str, value) -> None:
    """Attach ``key = value`` to parameter ``param_name`` of this module.

    The metadata lives on the parameter (``slapo.get_annotations(param)``, and as the
    attribute ``param.<key>``, as upstream Slapo kept it; ``sch.metadata.param_tags`` lists
    the keys in use), is copied onto
    the new parameter when the parameter is sharded, and onto the same-named parameter of a
    module that replaces this one. Frameworks read it, for example to skip weight decay or to
    tell a data-parallel engine which parameters are replicated.

    Example::

        sch["encoder.layer.0.output.LayerNorm"].annotate("weight", "replicated", True)
    """
    set_annotation(get_param(sch, param_name), key, value, f"{sch.path or '<root>'}.{param_name}")
