"""DeepSeek V4.1 Flash's new numerical steps (issue 33) in plain torch float32, one per module, each
checked against a restatement of V4.1's reference (shared/spec/RELEASES_2026.md lists it) in its tests (tests/v41)."""
