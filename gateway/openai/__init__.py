"""The edge: OpenAI's HTTP API on Starlette; knows our types, never gRPC."""
