"""The math of GPTQ: quantization grids, Hessians, factorisation and the solvers.

Tensors in, tensors out: nothing here knows an ``nn.Module``, a model or a file.
"""
