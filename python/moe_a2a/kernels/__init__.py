"""Small fused kernels of the training path (Triton on CUDA, torch elsewhere)."""
