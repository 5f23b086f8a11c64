"""The disk KV cache, apart from the live session: the state payload (`payload.py`), the checkpoint
file around it (`kvfile.py`), what to keep (`kvpolicy.py`) and the directory of checkpoints under a
byte budget (`kvstore.py`)."""
