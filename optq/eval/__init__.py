"""Measuring quality: perplexity and side-by-side comparisons of quantization variants."""
