"""`dwarfstar agent`: a coding agent that runs the model in-process, its sessions KV files on disk.

Layout: `files.py` and `shell.py` are the tools, `tools.py` their schemas and dispatch, `transcript.py`
the conversation as tokens, `loop.py` the agent loop on a live session, `compaction.py` the context
triggers, `store.py` the saved sessions, `worker.py` the thread that owns the session, `commands.py`
the slash commands, and `plain.py` / `tui.py` the two front ends.
"""
