"""What an answer's events weigh, for every buffer and window that holds them.

The buffers that stand between a worker and a slow reader (the worker's
read-ahead, the multiplexed call's window, the edge's per-stream buffer) were
counted in characters of text. An event with logprobs carries far more than its
text: with `top_logprobs` 20, one token of one character is a token and twenty
alternatives, each a string and a float. Counted as one character, a stream of
them held ~400 MB for a stalled reader. So each is counted here by what it
carries: its text, a tool call's arguments, and for each logprob its token and
its alternatives, each with `LOGPROB_BYTES` for its number and framing.

Also the bound on what one request may make (`output_units`): tokens times the
entries each carries, summed over its choices, so a request that cannot fit is
refused before it runs.

The cost: one length on the token path; a loop over the logprobs only when
they were asked for.
"""

from __future__ import annotations

from gateway.protocol.types import Event, Reasoning, Text, ToolCallDelta

#: What one logprob entry (a token's or an alternative's) costs beyond its token's
#: text: the float and the framing around it (in the protocol, or in JSON).
LOGPROB_BYTES = 16


def event_size(event: Event) -> int:
    """An event's weight in a buffer: about the bytes of what it carries (a `Text`
    without logprobs: its characters, as these buffers counted before)."""
    kind = type(event)
    if kind is Text:
        text: Text = event  # type: ignore[assignment]
        size = len(text.text)
        logprobs = text.logprobs
        if logprobs:
            for logprob in logprobs:
                size += LOGPROB_BYTES + len(logprob.token)
                for token, _ in logprob.top:
                    size += LOGPROB_BYTES + len(token)
        return size
    if kind is Reasoning:
        return len(event.text)  # type: ignore[union-attr]
    if kind is ToolCallDelta:
        delta: ToolCallDelta = event  # type: ignore[assignment]
        return len(delta.arguments) + len(delta.name) + len(delta.id)
    return 1


def output_units(n: int, max_tokens: int, top_logprobs: int | None) -> int:
    """Entries one request may make: `n` choices of `max_tokens` tokens, each its
    text, plus, when logprobs are asked for (`top_logprobs` not None), its own
    logprob and its `top_logprobs` alternatives."""
    per_token = 1 if top_logprobs is None else 2 + top_logprobs
    return n * max_tokens * per_token
