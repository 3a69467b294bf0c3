"""``slapo.logger.get_logger``: upstream Slapo's logger, whose calls can be limited to ranks.

    logger = get_logger(__name__)
    logger.info("scheduling", ranks=0)      # only rank 0 logs it
    logger.warning("odd shape", ranks=[0, 1])

Without ``ranks`` every rank logs. Records go through the standard ``logging`` module, so
handlers, levels and formats are the application's.
"""

from __future__ import annotations

import logging

import torch.distributed as dist


class RankLogger(logging.LoggerAdapter):
    """A logger whose ``debug``/``info``/``warning``/``error``/``critical`` take ``ranks=``."""

    def log(self, level, msg, *args, ranks=None, **kwargs):
        if ranks is not None:
            rank = dist.get_rank() if dist.is_initialized() else 0
            if rank not in ([ranks] if isinstance(ranks, int) else list(ranks)):
                return
        self.logger.log(level, msg, *args, **kwargs)

    def debug(self, msg, *args, **kwargs):
        self.log(logging.DEBUG, msg, *args, **kwargs)

    def info(self, msg, *args, **kwargs):
        self.log(logging.INFO, msg, *args, **kwargs)

    def warning(self, msg, *args, **kwargs):
        self.log(logging.WARNING, msg, *args, **kwargs)

    def error(self, msg, *args, **kwargs):
        self.log(logging.ERROR, msg, *args, **kwargs)

    def critical(self, msg, *args, **kwargs):
        self.log(logging.CRITICAL, msg, *args, **kwargs)


def get_logger(name: str = "slapo", level: int | None = None) -> RankLogger:
    """The logger ``name`` (``logging.getLogger``), at ``level`` if given."""
    logger = logging.getLogger(name)
    if level is not None:
        logger.setLevel(level)
    return RankLogger(logger, {})
