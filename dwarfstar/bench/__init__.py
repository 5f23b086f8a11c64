"""Measurement code shared by the `dwarfstar bench` commands: the context-frontier speed benchmark and
the bytes a decoded token reads (`frontier.py`), and the machine's read rate (`bandwidth.py`)."""
