"""Quantization that keeps the nesting: FP8 / NVFP4 numerics (`formats`), the quantized leaf that
slices like its float weight (`qtensor`), and which params are quantized (`tree`)."""
