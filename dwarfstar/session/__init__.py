"""The backend-neutral session layer: live sequences, sampling, snapshots and the disk KV cache."""
