"""The GPU benchmark (``python -m benchmarks.gpu.run``): trainer tokens/s on CUDA against the CPU, weight publish,
and vLLM on a GPU, on a model built in code; it runs on the CPU too with a small model. Not part of CI."""
