"""The ways of reaching a worker, one module each behind one interface (`base`):

    base.py          Upstream and UpstreamCall: what the fleet needs of any worker
    furnace_grpc.py  our worker protocol over one grpc.aio channel per worker
    furnace_multiplex.py  every request to a worker on one GenerateMultiplexed call
    furnace_channel.py    the channel options and status translation both share
    openai_http/     OpenAI-compatible HTTP servers (vLLM, SGLang, ...): JSON both ways
                     (translate), SSE (sse), raw keep-alive connections, httpx (upstream)
    vllm_grpc.py     vLLM's own gRPC server (token ids; the gateway tokenizes)
    kserve_grpc.py   KServe v2 gRPC servers (Triton, KServe, ours): tensor models
    vllm_kv.py       vLLM's KV-cache events, as its gRPC server relays them, as ours

Each translates its foreign failures into the error tree through one table,
and knows nothing of OpenAI's wire shapes or the edge.
"""
