"""GGUF container I/O and ggml quant formats."""
