"""Whole models: block and linear discovery, input capture and replay, the block loop, the
report. Imports ``optq.core``, ``optq.formats`` and ``optq.data``.
"""
