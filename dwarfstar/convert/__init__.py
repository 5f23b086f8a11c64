"""Checkpoint conversion into ds4-layout GGUF files."""
