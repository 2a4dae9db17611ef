"""From solutions to bytes and back: bit packing, ``QuantLinear`` and the checkpoint formats
(gptq, gptq_v2, compressed-tensors) with their file plumbing. Imports ``optq.core`` only.
"""
