"""The disk KV cache, apart from the live session: the state payload (`payloads.py`: ds4's DSV4 layout
in `payload.py`, V4.1's DS41 in `payload_v41.py`), the checkpoint file around it (`kvfile.py`), what
to keep (`kvpolicy.py`) and the directory of checkpoints under a byte budget (`kvstore.py`)."""
