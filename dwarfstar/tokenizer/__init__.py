"""The DeepSeek V4 tokenizer, stored in and loaded from GGUF metadata."""
