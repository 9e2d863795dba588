"""Speech to text on the fleet: one call on one of the model's workers
(`Transcribes.transcribe`), with the time left as its deadline and the balancing,
ejection and retry rules of the fleet's unary calls (`unary`). A failure goes to another
worker while nothing of the answer reached the client: a whole answer comes at once, a
stream's text goes out as it comes, and after its first piece no other worker may start
it again.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from gateway.fleet.unary import call_unary
from gateway.protocol import errors
from gateway.protocol.deadline import Deadline
from gateway.protocol.types import AudioRequest, Transcript
from gateway.upstreams.base import Transcribes

if TYPE_CHECKING:
    from gateway.fleet import Fleet
    from gateway.fleet.pool import ModelPool
    from gateway.fleet.worker import Worker


async def transcribe(
    fleet: Fleet,
    pool: ModelPool,
    request: AudioRequest,
    deadline: Deadline,
    metadata: tuple[tuple[str, str], ...] = (),
    on_text: Callable[[str], Awaitable[None]] | None = None,
) -> tuple[Transcript, str]:
    """The transcript from a worker of `pool`, and that worker's address; a stream's
    texts handed to `on_text` as they come."""
    sent = False

    async def relay(text: str) -> None:
        nonlocal sent
        sent = True
        assert on_text is not None
        await on_text(text)

    async def call(worker: Worker) -> Transcript:
        upstream = worker.upstream
        if not isinstance(upstream, Transcribes):  # our workers, vLLM's gRPC server
            raise errors.Invalid(
                f"The model `{pool.name}` does not serve speech to text.", param="model"
            )
        streamed = None if on_text is None else relay
        return await upstream.transcribe(request, deadline.remaining(), metadata, streamed)

    def retry(error: errors.GatewayError) -> bool:
        return error.retryable and not sent

    try:
        transcript, worker = await call_unary(fleet, pool, deadline, call, retry)
    except errors.GatewayError as error:
        if sent and error.retryable:  # nor may a fallback start it again
            raise errors.Failed(f"The transcript broke off: {error}") from None
        raise
    return transcript, worker.address
