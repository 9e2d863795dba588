"""Our types to the protocol's messages and back, both directions in one place:
the gateway's gRPC upstream sends requests and reads events with these, and the
worker SDK reads requests and sends events with the same functions, so the two
ends of the protocol cannot drift apart.

Events are converted one message at a time on the token path, so these stay
plain functions over small tuples, with no allocation beyond the result.
"""

from __future__ import annotations

from gateway.protocol import errors
from gateway.protocol.types import (
    Event,
    Finished,
    FinishReason,
    GenerateRequest,
    Message,
    SamplingParams,
    Started,
    Text,
)
from gateway.protocol.v1 import engine_pb2 as pb

#: Our finish reasons → the protocol's enum, and back.
REASON_TO_PROTO = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
}
PROTO_TO_REASON = {value: key for key, value in REASON_TO_PROTO.items()}


def request_to_proto(request: GenerateRequest) -> pb.GenerateRequest:
    """Our request as the protocol's message."""
    s = request.sampling
    sampling = pb.SamplingParams(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        seed=s.seed,
        max_tokens=s.max_tokens,
    )
    message = pb.GenerateRequest(
        request_id=request.request_id,
        model=request.model,
        sampling=sampling,
        stop=request.stop,
    )
    if request.messages is not None:
        message.chat.messages.extend(
            pb.ChatMessage(role=m.role, content=m.content) for m in request.messages
        )
    else:
        message.text = request.prompt or ""
    return message


def request_from_proto(message: pb.GenerateRequest) -> GenerateRequest:
    """The protocol's request as ours."""
    s = message.sampling
    # proto3 `optional` fields: None where the client left one unset
    sampling = SamplingParams(
        temperature=s.temperature if s.HasField("temperature") else None,
        top_p=s.top_p if s.HasField("top_p") else None,
        top_k=s.top_k if s.HasField("top_k") else None,
        presence_penalty=s.presence_penalty if s.HasField("presence_penalty") else None,
        frequency_penalty=s.frequency_penalty if s.HasField("frequency_penalty") else None,
        seed=s.seed if s.HasField("seed") else None,
        max_tokens=s.max_tokens if s.HasField("max_tokens") else None,
    )
    chat = None
    if message.WhichOneof("prompt") == "chat":
        chat = tuple(Message(m.role, m.content) for m in message.chat.messages)
    return GenerateRequest(
        model=message.model,
        prompt=message.text if chat is None else None,
        messages=chat,
        sampling=sampling,
        stop=tuple(message.stop),
        request_id=message.request_id,
    )


def event_to_proto(event: Event) -> pb.GenerateEvent:
    """One of our events as the protocol's message."""
    if type(event) is Text:
        return pb.GenerateEvent(text=pb.Text(text=event.text, tokens=event.tokens))
    if type(event) is Started:
        return pb.GenerateEvent(started=pb.Started(prompt_tokens=event.prompt_tokens))
    assert type(event) is Finished
    return pb.GenerateEvent(
        finished=pb.Finished(
            reason=REASON_TO_PROTO[event.reason], completion_tokens=event.completion_tokens
        )
    )


def event_from_proto(message: pb.GenerateEvent) -> Event:
    """The protocol's event as ours; `Failed` for an event this version does not know."""
    kind = message.WhichOneof("event")
    if kind == "text":
        text = message.text
        return Text(text.text, text.tokens)
    if kind == "started":
        return Started(message.started.prompt_tokens)
    if kind == "finished":
        finished = message.finished
        reason = PROTO_TO_REASON.get(finished.reason)
        if reason is None:  # UNSPECIFIED, or a value this version does not know
            raise errors.Failed(f"engine worker finished with an unknown reason {finished.reason}")
        return Finished(reason, finished.completion_tokens)
    raise errors.Failed(f"engine worker sent an unknown event {kind!r}")
