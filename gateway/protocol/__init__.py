"""The worker protocol, standing alone: what the gateway and the worker SDK both
speak, with nothing of the gateway's server in it (it imports grpc and
protobuf, never starlette, uvicorn, httpx, redis or prometheus_client).

    types.py    our request and event types, passed between every layer
    errors.py   the one error tree, with each error's outcome and reason
    status.py   the one table between gRPC status codes and those errors
    convert.py  our types to the protocol's messages and back, both ways
    sizes.py    what an event weighs in a buffer or window; what a request may make
    tls.py      TLS credentials for both ends, from PEM files
    v1/         the generated stubs of `furnace.engine.v1` (protos/generate.py);
                a v2 goes beside it
"""
