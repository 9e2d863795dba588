"""The worker SDK: wrap any engine as a gRPC worker of furnace-gateway.

Implement `Engine` (an async generator of our events per request), then serve
it with `WorkerServer`. The SDK handles cancellation, deadlines, stop strings,
coalescing of ready tokens, `Describe`, and the standard health service.

    engine.py              the interface a model runtime implements
    servicer.py            the gRPC Engine service over any `Engine`
    multiplex.py           many requests on one GenerateMultiplexed call
    server.py              the gRPC server: the service, health, TLS
    demo.py                the demo engine: deterministic, no model
    transformers_engine.py a Hugging Face causal LM, token by token (`transformers` extra)
    vllm_engine.py         vLLM's AsyncLLM in this process (in vLLM's environment)
    tensor/                our tensor worker: KServe v2 gRPC over ONNX models
    kv_events.py     an engine's KV-cache events on the worker protocol
"""

from gateway.worker.engine import Engine
from gateway.worker.server import WorkerServer

__all__ = ["Engine", "WorkerServer"]
