"""Text and models from offline packages: corpora, calibration and evaluation token sets, the
model zoo. Imports ``optq.core`` and ``optq.formats`` (to open quantized checkpoints) only.
"""
