"""Compute backends that lower the model description: reference (torch), triton, mlx."""
