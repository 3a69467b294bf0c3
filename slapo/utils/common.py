"""``get_hooks(module)``: the hooks registered on a module, by upstream Slapo's kinds."""

from __future__ import annotations

from torch import nn


def get_hooks(module: nn.Module) -> dict[str, list]:
    """``{"fwd_pre": [...], "fwd_post": [...], "bwd_post": [...]}``: the module's forward
    pre-hooks, forward hooks and backward hooks (full and old-style), in registration order,
    as registered on the module with torch (``register_forward_pre_hook``, ...) or through
    ``sync``. Hooks of the submodules are not included."""
    return {"fwd_pre": list(module._forward_pre_hooks.values()),
            "fwd_post": list(module._forward_hooks.values()),
            "bwd_post": list(module._backward_hooks.values())}
