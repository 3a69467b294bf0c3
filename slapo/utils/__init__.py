"""Upstream Slapo's ``slapo.utils`` helpers (``common.get_hooks``, ``report.report_memory``)."""
