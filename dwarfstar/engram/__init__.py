"""V4.1's Engram tables: their rows' format (`rows.py`) and the store that reads them from the disk (`store.py`)."""
