"""furnace-gateway: an OpenAI-compatible gateway in front of gRPC GPU engine workers."""

__version__ = "0.1.0"
