"""The interactive console: the chat loop over a session (`chat.py`), the line editor that drives it
(`repl.py`), the terminal output (`terminal.py`) and the trace of a chat's decisions (`diagnostics.py`)."""
