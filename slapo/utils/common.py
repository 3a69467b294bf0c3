"""``get_hooks(module)``: the hooks registered on a module, by upstream Slapo's kinds."""

from __future__ import annotations

from torch import nn

from ..tracing import is_inert_hook


def get_hooks(module: nn.Module) -> dict[str, list]:
    """``{"fwd_pre": [...], "fwd_post": [...], "bwd_post": [...]}``: the module's forward
    pre-hooks, forward hooks and backward hooks (full and old-style), in registration order,
    as registered on the module with torch (``register_forward_pre_hook``, ...) or through
    ``sync``. Hooks of the submodules are not included, nor the call adapter of a traced
    module (slapo's plumbing that maps the module's call onto its graph)."""
    def kept(hooks):
        return [hook for hook in hooks.values() if not is_inert_hook(hook)]
    return {"fwd_pre": kept(module._forward_pre_hooks),
            "fwd_post": kept(module._forward_hooks),
            "bwd_post": kept(module._backward_hooks)}
