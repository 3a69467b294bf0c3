"""The error of a failed trace, raised by every part of the tracer (kept apart so that the
other modules of this package can raise it without importing the tracer)."""

from __future__ import annotations

import torch.fx as fx


class TraceError(fx.proxy.TraceError):
    """A module could not be traced. ``path`` and ``module_class`` name the module that failed
    (the innermost one being traced when the error happened)."""

    def __init__(self, message: str, path: str = "", module_class: str = ""):
        super().__init__(message)
        self.path = path
        self.module_class = module_class
