"""Our types to the protocol's messages and back, both directions in one place:
the gateway's gRPC upstream sends requests and reads events with these, and the
worker SDK reads requests and sends events with the same functions, so the two
ends of the protocol cannot drift apart.

Events are converted one message at a time on the token path, so these stay
plain functions over small tuples, with no allocation beyond the result: a
`Text` without logprobs costs what it cost before the protocol grew (one
constructor each way); logprobs, tool calls and choices past the first pay for
themselves only when present.
"""

from __future__ import annotations

from typing import Any

from google.protobuf.internal.containers import RepeatedCompositeFieldContainer

from gateway.protocol import errors
from gateway.protocol.types import (
    ContentPart,
    Embeddings,
    EmbedRequest,
    Event,
    Finished,
    FinishReason,
    GenerateRequest,
    Message,
    Reasoning,
    ReasoningParams,
    ResponseFormat,
    SamplingParams,
    Started,
    Text,
    TokenLogprob,
    Tool,
    ToolCall,
    ToolCallDelta,
)
from gateway.protocol.v1 import engine_pb2 as pb

#: Our finish reasons → the protocol's enum, and back.
REASON_TO_PROTO = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.TOOL_CALLS: pb.FINISH_REASON_TOOL_CALLS,
}
PROTO_TO_REASON = {value: key for key, value in REASON_TO_PROTO.items()}


# -- requests -----------------------------------------------------------------


def _message_to_proto(m: Message) -> pb.ChatMessage:
    return pb.ChatMessage(
        role=m.role,
        content=m.content,
        images=m.images,
        tool_calls=[pb.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in m.tool_calls],
        tool_call_id=m.tool_call_id,
        name=m.name,
        parts=[
            pb.ContentPart(type=p.type, text=p.text, image_url=p.url, detail=p.detail)
            for p in m.parts
        ],
        reasoning=m.reasoning,
    )


def _message_from_proto(m: pb.ChatMessage) -> Message:
    return Message(
        m.role,
        m.content,
        tuple(m.images),
        tuple(ToolCall(c.id, c.name, c.arguments) for c in m.tool_calls),
        m.tool_call_id,
        m.name,
        tuple(ContentPart(p.type, p.text, p.image_url, p.detail) for p in m.parts),
        m.reasoning,
    )


def request_to_proto(request: GenerateRequest) -> pb.GenerateRequest:
    """Our request as the protocol's message; a field left at its default is
    not sent, so a first-version request is the first version's message. Only
    the fields a request sets are given to the message (each keyword costs the
    constructor as much as a set field: a third of this function's time)."""
    s = request.sampling
    sampling = pb.SamplingParams(**s.given())
    if s.logit_bias:
        sampling.logit_bias.update(s.logit_bias)
    if s.stop_token_ids:
        sampling.stop_token_ids.extend(s.stop_token_ids)
    message = pb.GenerateRequest(
        request_id=request.request_id, model=request.model, sampling=sampling
    )
    if request.stop:
        message.stop.extend(request.stop)
    if request.n != 1:
        message.n = request.n
    if request.logprobs is not None:
        message.logprobs = request.logprobs
    if request.tools:
        message.tools.extend(
            pb.Tool(
                name=t.name, description=t.description, parameters=t.parameters, strict=t.strict
            )
            for t in request.tools
        )
    if request.tool_choice:
        message.tool_choice = request.tool_choice
    if request.parallel_tool_calls is not None:
        message.parallel_tool_calls = request.parallel_tool_calls
    if request.user:
        message.user = request.user
    if request.include_stop:
        message.include_stop = True
    if not request.skip_special_tokens:
        message.skip_special_tokens = False
    if request.truncate_prompt_tokens is not None:
        message.truncate_prompt_tokens = request.truncate_prompt_tokens
    if request.return_token_ids:
        message.return_token_ids = True
    f = request.response_format
    if f is not None:
        message.response_format.CopyFrom(
            pb.ResponseFormat(
                type=f.type,
                schema=f.schema,
                name=f.name,
                strict=f.strict,
                regex=f.regex,
                choice=f.choice,
                grammar=f.grammar,
            )
        )
    r = request.reasoning
    if r is not None:
        options = message.reasoning
        options.SetInParent()  # `off` alone still says so
        options.effort, options.exclude = r.effort, not r.include
        options.template_kwargs, options.off = r.template_kwargs, r.off
        if r.budget is not None:
            options.budget = r.budget
    if request.messages is not None:
        chat = message.chat
        chat.messages.extend(_message_to_proto(m) for m in request.messages)
        if request.continue_final_message:
            chat.continue_final_message = True
        if not request.add_generation_prompt:
            chat.add_generation_prompt = False
    else:
        message.text = request.prompt or ""
    return message


def request_from_proto(message: pb.GenerateRequest) -> GenerateRequest:
    """The protocol's request as ours (n 0 is 1; an empty response format is none)."""
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
        min_tokens=s.min_tokens if s.HasField("min_tokens") else None,
        ignore_eos=s.ignore_eos if s.HasField("ignore_eos") else None,
        repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else None,
        min_p=s.min_p if s.HasField("min_p") else None,
        logit_bias=tuple(sorted(s.logit_bias.items())),
        stop_token_ids=tuple(s.stop_token_ids),
    )
    chat, generation_prompt, open_end = None, True, False
    if message.WhichOneof("prompt") == "chat":
        c = message.chat
        chat = tuple(_message_from_proto(m) for m in c.messages)
        open_end = c.continue_final_message
        generation_prompt = c.add_generation_prompt if c.HasField("add_generation_prompt") else True
    f = message.response_format
    reasoning = None
    if message.HasField("reasoning"):
        r = message.reasoning
        reasoning = ReasoningParams(
            r.effort,
            not r.exclude,
            r.template_kwargs,
            r.budget if r.HasField("budget") else None,
            r.off,
        )
    return GenerateRequest(
        model=message.model,
        prompt=message.text if chat is None else None,
        messages=chat,
        sampling=sampling,
        stop=tuple(message.stop),
        request_id=message.request_id,
        n=message.n or 1,
        logprobs=message.logprobs if message.HasField("logprobs") else None,
        tools=tuple(Tool(t.name, t.description, t.parameters, t.strict) for t in message.tools),
        tool_choice=message.tool_choice,
        parallel_tool_calls=(
            message.parallel_tool_calls if message.HasField("parallel_tool_calls") else None
        ),
        response_format=(
            ResponseFormat(f.type, f.schema, f.name, f.strict, f.regex, tuple(f.choice), f.grammar)
            if f.type
            else None
        ),
        user=message.user,
        reasoning=reasoning,
        add_generation_prompt=generation_prompt,
        continue_final_message=open_end,
        include_stop=message.include_stop,
        skip_special_tokens=(
            message.skip_special_tokens if message.HasField("skip_special_tokens") else True
        ),
        truncate_prompt_tokens=(
            message.truncate_prompt_tokens if message.HasField("truncate_prompt_tokens") else None
        ),
        return_token_ids=message.return_token_ids,
    )


# -- events -------------------------------------------------------------------


def _logprobs_to_proto(logprobs: tuple[TokenLogprob, ...]) -> list[pb.TokenLogprob]:
    return [
        pb.TokenLogprob(
            token=lp.token,
            logprob=lp.logprob,
            top=[pb.TopLogprob(token=t, logprob=p) for t, p in lp.top],
        )
        for lp in logprobs
    ]


def _logprobs_from_proto(
    logprobs: RepeatedCompositeFieldContainer[pb.TokenLogprob],
) -> tuple[TokenLogprob, ...]:
    return tuple(
        TokenLogprob(lp.token, lp.logprob, tuple((t.token, t.logprob) for t in lp.top))
        for lp in logprobs
    )


def event_to_proto(event: Event) -> pb.GenerateEvent:
    """One of our events as the protocol's message."""
    if type(event) is Text:
        if event.logprobs is None:  # the token path: as cheap as the first version's
            if event.index:
                text = pb.Text(text=event.text, tokens=event.tokens, index=event.index)
            else:
                text = pb.Text(text=event.text, tokens=event.tokens)
        else:
            text = pb.Text(
                text=event.text,
                tokens=event.tokens,
                index=event.index,
                logprobs=_logprobs_to_proto(event.logprobs),
            )
        return pb.GenerateEvent(text=text)
    if type(event) is ToolCallDelta:
        return pb.GenerateEvent(
            tool_call=pb.ToolCallDelta(
                index=event.index,
                call_index=event.call_index,
                id=event.id,
                name=event.name,
                arguments=event.arguments,
                tokens=event.tokens,
            )
        )
    if type(event) is Reasoning:
        return pb.GenerateEvent(
            reasoning=pb.Reasoning(text=event.text, tokens=event.tokens, index=event.index)
        )
    if type(event) is Started:
        started = pb.Started(prompt_tokens=event.prompt_tokens, cached_tokens=event.cached_tokens)
        return pb.GenerateEvent(started=started)
    assert type(event) is Finished
    return pb.GenerateEvent(
        finished=pb.Finished(
            reason=REASON_TO_PROTO[event.reason],
            completion_tokens=event.completion_tokens,
            index=event.index,
            stop_sequence=event.stop_sequence,
        )
    )


def event_with_ids_to_proto(event: Event) -> pb.GenerateEvent:
    """`event_to_proto` for a request that asked for token ids (`return_token_ids`):
    the event's ids (a `Started`'s prompt's) on its message too. A request of its own
    converter, so the others' token path reads no ids."""
    message = event_to_proto(event)
    if type(event) is Started:
        if event.prompt_token_ids:
            message.started.prompt_token_ids.extend(event.prompt_token_ids)
        return message
    ids = event.token_ids  # type: ignore[union-attr]
    if ids:
        getattr(message, message.WhichOneof("event")).token_ids.extend(ids)
    return message


def _ids(field: Any) -> tuple[int, ...]:
    """A repeated field of ids as our events carry them."""
    return tuple(field)


def event_from_proto(message: pb.GenerateEvent, details: bool = False) -> Event:
    """The protocol's event as ours; `Failed` for an event this version does not know.
    A `Text`'s logprobs and the events' token ids are read only with `details` (the
    request asked for logprobs or for ids): looking at an empty repeated field costs a
    third of the whole conversion."""
    kind = message.WhichOneof("event")
    if kind == "text":
        text = message.text
        if details:
            logprobs = _logprobs_from_proto(text.logprobs) if text.logprobs else None
            ids = _ids(text.token_ids) if text.token_ids else None
            return Text(text.text, text.tokens, text.index, logprobs, ids)
        return Text(text.text, text.tokens, text.index)
    if kind == "tool_call":
        d = message.tool_call
        ids = _ids(d.token_ids) if details and d.token_ids else None
        return ToolCallDelta(d.index, d.call_index, d.id, d.name, d.arguments, d.tokens, ids)
    if kind == "reasoning":
        thought = message.reasoning
        ids = _ids(thought.token_ids) if details and thought.token_ids else None
        return Reasoning(thought.text, thought.tokens, thought.index, ids)
    if kind == "started":
        started = message.started
        prompt = _ids(started.prompt_token_ids) if details and started.prompt_token_ids else None
        return Started(started.prompt_tokens, started.cached_tokens, prompt)
    if kind == "finished":
        finished = message.finished
        reason = PROTO_TO_REASON.get(finished.reason)
        if reason is None:  # UNSPECIFIED, or a value this version does not know
            raise errors.Failed(f"engine worker finished with an unknown reason {finished.reason}")
        ids = _ids(finished.token_ids) if details and finished.token_ids else None
        return Finished(
            reason,
            finished.completion_tokens,
            None,
            finished.index,
            finished.stop_sequence,
            None,
            ids,
        )
    raise errors.Failed(f"engine worker sent an unknown event {kind!r}")


# -- embeddings ---------------------------------------------------------------


def embed_request_to_proto(request: EmbedRequest) -> pb.EmbedRequest:
    """Our embedding request as the protocol's message."""
    return pb.EmbedRequest(
        request_id=request.request_id,
        model=request.model,
        inputs=[
            pb.EmbedInput(text=i)
            if isinstance(i, str)
            else pb.EmbedInput(tokens=pb.TokenIds(ids=i))
            for i in request.inputs
        ],
        dimensions=request.dimensions,
        user=request.user,
    )


def embed_request_from_proto(message: pb.EmbedRequest) -> EmbedRequest:
    """The protocol's embedding request as ours."""
    return EmbedRequest(
        model=message.model,
        inputs=tuple(
            tuple(i.tokens.ids) if i.WhichOneof("input") == "tokens" else i.text
            for i in message.inputs
        ),
        dimensions=message.dimensions if message.HasField("dimensions") else None,
        user=message.user,
        request_id=message.request_id,
    )


def embeddings_to_proto(embeddings: Embeddings) -> pb.EmbedResponse:
    """Our embeddings as the protocol's answer."""
    return pb.EmbedResponse(
        embeddings=[pb.Embedding(values=v) for v in embeddings.vectors],
        prompt_tokens=embeddings.prompt_tokens,
    )


def embeddings_from_proto(message: pb.EmbedResponse) -> Embeddings:
    """The protocol's answer as our embeddings (floats, as float32 carried them)."""
    return Embeddings(tuple(tuple(e.values) for e in message.embeddings), message.prompt_tokens)
