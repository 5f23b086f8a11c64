"""DeepSeek V4.1 Flash's new numerical steps (issue 33) in plain torch float32, one per module, each
checked against a restatement of /work/notes/v41_spec.md in its tests (tests/v41)."""
