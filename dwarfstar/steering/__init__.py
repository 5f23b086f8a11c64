"""Directional steering compatible with ds4's files: `direction` (the file and the math), `apply`
(the hooks in every backend), `probe` (capturing activations to build and evaluate a direction)."""
