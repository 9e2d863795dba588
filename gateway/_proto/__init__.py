"""Generated stubs of protos/furnace/engine/v1/engine.proto; regenerate with protos/generate.py."""
