"""Training support for the bundled nano model: trainable weights, corpus, export (tools/train_nano.py)."""
