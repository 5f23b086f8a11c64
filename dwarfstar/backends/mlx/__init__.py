"""MLX backend for Apple silicon, with custom Metal kernels and a portable built-in-ops path."""
