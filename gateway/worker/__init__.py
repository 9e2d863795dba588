"""The worker SDK: wrap any engine as a gRPC worker of furnace-gateway.

Implement `Engine` (an async generator of our events per request), then serve
it with `WorkerServer`. The SDK handles cancellation, deadlines, stop strings,
coalescing of ready tokens, `Describe`, and the standard health service.
"""

from gateway.worker.engine import Engine
from gateway.worker.server import WorkerServer

__all__ = ["Engine", "WorkerServer"]
