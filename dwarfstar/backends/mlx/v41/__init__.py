"""DeepSeek V4.1 on MLX: `model.MLXOps41` (V4.1's steps in MLX under `model.forward_v41.Transformer41`)
and `backend.MLXModel41` (what the session layer drives). The new numerics (window, csa2, select,
engram) mirror the torch reference's modules of the same names (`backends/reference/v41`)."""
