"""The backend-neutral description of DeepSeek V4: config, tensor inventory, loader."""
