"""The worker protocol, standing alone: what the gateway and the worker SDK both
speak, with nothing of the gateway's server in it (it imports grpc and
protobuf, never starlette, uvicorn, httpx, redis or prometheus_client).

    types.py    our request and event types, passed between every layer
    errors.py   the one error tree, with each error's outcome and reason
    status.py   the one table between gRPC status codes and those errors
    convert.py  our types to the protocol's messages and back, both ways
    grpc_options.py  the gRPC options of both ends, the largest message among them
    deadline.py Deadline: the clock of one request, down to the worker's call
    sizes.py    what an event weighs in a buffer or window; what a request may make
    tls.py      TLS credentials for both ends, from PEM files
    v1/         the generated stubs of `furnace.engine.v1` (protos/generate.py);
                a v2 goes beside it
    chat.py          our messages and tools in the shapes chat templates take
    features.py      what a model's workers serve beyond plain text, by OpenAI's names
    kserve_v2/       the generated stubs of the KServe v2 inference protocol
    kv_blocks.py     KV-cache blocks as the gateway names them, and the events about them
    _kv_blocks.c     kv_blocks' chain and walk in C, built where a compiler is
    kv_proto.py      those events to the worker protocol's KvEventBatch and back
    kv_zmq.py        vLLM's KV-cache events as its ZMQ publisher sends them, as ours
    kv_transfer.py   prefill/decode disaggregation's handoff, as vLLM's NixlConnector has it
    multiplex.py     what both ends of GenerateMultiplexed agree on: the window, ends
    stop.py          stop strings over a stream of text pieces, in linear time
    reasoning.py     a reasoning model's answer cut into reasoning and text at `</think>`
    detokenize.py    ids to text as they come, never half a character (gateway and worker)
    token_ids.py     an engine's sampled ids handed to its events (`return_token_ids`)
    tensors.py       KServe v2 tensors: datatypes, JSON tensors checked, raw contents packed
    inference.py     a KServe v2 inference, its result and a model's metadata, our types
    tool_calls/      tool calls in a model's text, per format, and the schema that forces them
    http1.py         HTTP/1.1 client connections over httptools, pooled (raw HTTP
                     upstreams and the benchmark's load generator)
    grpc_h2.py       server-streaming gRPC calls over an HTTP/2 client on the loop
                     (vLLM's Generate stream, half grpc.aio's CPU a message)
    h2_fields.py     its HPACK: fixed header fields encoded once, indexed blocks decoded once
"""
