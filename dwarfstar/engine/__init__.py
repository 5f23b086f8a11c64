"""The engine a command runs on: what to load and how (`spec.py`: `EngineSpec`), loading it (`load.py`:
`load_engine`), and running it as a coordinator or worker of a layer pipeline (`launch.py`)."""
