"""Schedules of the paper's models, one module per family."""
