"""One file per op: each holds its Triton kernel(s), the launch wrapper, its torch reference and bench cases."""
