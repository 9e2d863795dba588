"""Generated stubs of protos/furnace/engine/v1/engine.proto: run `python protos/generate.py`."""
