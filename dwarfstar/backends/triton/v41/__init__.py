"""DeepSeek V4.1 on the Triton kernels (issue 33): `forward_v41.Transformer41` over `TritonOps41`."""
