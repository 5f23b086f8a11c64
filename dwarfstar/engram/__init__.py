"""V4.1's Engram tables: which rows a token looks up (`hashing.py`), a row's format (`rows.py`) and the store
that reads rows from the disk (`store.py`)."""
