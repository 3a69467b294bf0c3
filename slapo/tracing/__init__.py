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

Errors name the module that failed (path and class), with the reason from fx. A submodule
that cannot be traced (with ``flatten=False``) stays whole, one call in its parent's graph,
with a warning that gives that error; only the module ``trace_module`` runs on must trace.

Modules: ``proxies`` (traced values with example values), ``call_plan`` (graph inputs and
fixed arguments), ``tracer`` (the fx tracer and ``trace_module``), ``adapter`` (the pre-hook
above), ``errors`` (``TraceError``).
"""

from .errors import TraceError
from .proxies import ITEMS, KIND
from .tracer import (
    SlapoTracer,
    has_foreign_hooks,
    is_flattened,
    is_inert_hook,
    is_traced,
    trace_module,
)

__all__ = ["ITEMS", "KIND", "SlapoTracer", "TraceError", "has_foreign_hooks", "is_flattened",
           "is_inert_hook", "is_traced", "trace_module"]
