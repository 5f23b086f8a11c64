"""Metal kernel sources for `mx.fast.metal_kernel`, one module per kernel, plus the shared block decoders.

Each source is also valid C++ (with the small shim in tests/mlx/conftest.py), so the kernels are
executed and checked on machines without Metal by a CPU emulation of the thread grid.
"""
