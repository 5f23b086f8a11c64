"""The backend-neutral live session: a sequence on a backend (`session.py`), prompt-prefix reuse
(`prefix.py`), memory accounting, the loop guard and the decode-speed throttle. Sampling is
`dwarfstar/sampling.py`; the disk KV cache is `dwarfstar/kvcache/`."""
