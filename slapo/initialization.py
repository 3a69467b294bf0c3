"""Upstream Slapo's module of ``init_empty_weights`` (``slapo.build`` holds it here)."""

from .build import init_empty_weights

__all__ = ["init_empty_weights"]
