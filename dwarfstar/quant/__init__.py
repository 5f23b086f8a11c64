"""Quantization recipes, importance matrices, quality measurement and model inspection."""
