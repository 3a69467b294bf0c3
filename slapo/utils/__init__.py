"""Upstream Slapo's ``slapo.utils`` helpers (``common.get_hooks``, ``report.report_memory``,
also ``slapo.utils.report_memory`` as upstream's scripts import it)."""

from .report import report_memory

__all__ = ["report_memory"]
