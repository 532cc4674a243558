"""Quantization that keeps the nesting: FP8 / NVFP4 numerics and the FP8 matmul (`formats`), the
quantized leaf that slices like its float weight (`qtensor`), which params are quantized and in
which format (`tree`), and the input amaxes a W4A4 / W8A8 export needs (`calibrate`)."""
