"""Triton kernels for CUDA and ROCm (DGX Spark, H100/H200, Strix Halo)."""
