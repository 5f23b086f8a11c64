"""Speculative decoding: a draft model proposes tokens, the target verifies them in one pass, exactly.

`mtp` loads DeepSeek V4's MTP block (ds4's separate file or llama.cpp's in-file layout) as a
one-layer model on the target's backend; `verify` holds greedy verification and rejection sampling;
`decode` drives a `Session` with drafting, verification and rollback; `track` is the draft's side of
one sequence (on a route's last stage too).
"""
