"""`truncation: "auto"` (OpenAI's): a conversation too long for the model's context is
answered with items dropped from its beginning, rather than refused.

What must fit: the prompt's tokens and the answer's room, the client's
`max_output_tokens` (without it one token: vLLM's own check, `check_context`, wants a
prompt that leaves one token of the context), within the model's context (`max_context`,
as the workers' `Describe` or the model's `max_model_len` gives it; the route refuses
"auto" where it is unknown).

What is dropped: whole input items from the beginning of the conversation (a
`previous_response_id`'s stored turns or a `conversation`'s items, then this turn's
input), so that what is kept begins at a user message (every chat template takes a
conversation that begins with one, and a reasoning item goes with the turn after it)
and never separates a `function_call` from its `function_call_output`. Never dropped:
`instructions`, system and developer messages (those in the dropped part stay, in their
order), and the last user message with everything after it. Where even that leaves no
room for `max_output_tokens`, it is sent all the same (the worker cuts the answer at the
context, as it does without truncation); where even that is as long as the context, the
usual 400 (`context_length_exceeded`, naming `input`). vLLM's own Responses server maps
"auto" to cutting the prompt's tokens from the left, system prompt and all: not done here.

Counting: where the model's tokenizer is (`gateway.edge.counting.count_prompt`: a
worker's `CountTokens`, an OpenAI-compatible server's `/tokenize`, the gateway's own
tokenizer for `vllm-grpc`), in the request's slot, before its generation. The whole
prompt first: one count for every "auto" request, and the only one where it fits. No
sound bound from the body alone spares it: the chat template's text and an image's
tokens are the worker's to know. Where it does not fit, at most `MAX_COUNTS - 1` more:
the cut is estimated from the tokens to shed at the tokens per character of the items
(the first estimate from the whole prompt, the next from the two counts before it), and
counted to confirm; after two estimates that did not fit, the last user turn alone is
counted. Usually two counts in all: the whole prompt, then the estimated cut. A cut that
fits is sent even where a later one would have fitted too (the estimate may drop a few
more items than needed: it does not spend counts to find the latest cut).

The stored response keeps the whole conversation, as it was sent: the next turn's prompt
is cut again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gateway.edge.responses.params import Item, prompt_messages
from gateway.protocol import errors
from gateway.protocol.types import Message

if TYPE_CHECKING:
    from gateway.edge.counting import PromptCount

#: The most counts one request's truncation makes: the whole prompt, two estimated cuts,
#: the last user turn.
MAX_COUNTS = 4
#: An item's weight past its text, in characters (its role's and its template's tokens).
ITEM_CHARS = 16
#: An image's weight, in characters (its tokens are the model's processor's to know).
IMAGE_CHARS = 1024
#: Roles of messages that are instructions: never dropped.
INSTRUCTIONS = ("system", "developer")


@dataclass(frozen=True, slots=True)
class Fitted:
    """The prompt sent: its messages, its tokens, the items dropped, the counts made."""

    messages: tuple[Message, ...]
    tokens: int
    dropped: int
    counts: int


def _instruction(item: Item) -> bool:
    return item["type"] == "message" and item["role"] in INSTRUCTIONS


def _weight(item: Item) -> int:
    """An item's size for the estimate, in characters of its text."""
    if _instruction(item):
        return 0  # kept: dropping the items around it sheds none of its tokens
    kind = item["type"]
    if kind == "message":
        parts = item["content"]
        text = sum(len(p.get("text") or p.get("refusal") or "") for p in parts)
        images: int = sum(p["type"] == "input_image" for p in parts)
        return ITEM_CHARS + text + IMAGE_CHARS * images
    if kind == "function_call":
        return ITEM_CHARS + len(item["name"]) + len(item["arguments"])
    if kind == "function_call_output":
        return ITEM_CHARS + len(item["output"])
    if kind == "reasoning":
        parts = item.get("content") or item.get("summary") or ()
        return ITEM_CHARS + sum(len(p["text"]) for p in parts)
    return ITEM_CHARS


def cut_points(items: Sequence[Item]) -> list[int]:
    """The indices where the kept conversation may begin, in order: each user message
    with something droppable before it, where no function call is cut from its output."""
    split = [0] * (len(items) + 1)  # +1 over (first, last] of a call's items
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for i, item in enumerate(items):
        if item["type"] in ("function_call", "function_call_output"):
            first.setdefault(item["call_id"], i)
            last[item["call_id"]] = i
    for call_id, at in first.items():
        split[at + 1] += 1
        split[last[call_id] + 1] -= 1
    cuts = []
    inside = 0
    droppable = False
    for i, item in enumerate(items):
        inside += split[i]
        if item["type"] == "message" and item["role"] == "user" and droppable and not inside:
            cuts.append(i)
        droppable = droppable or not _instruction(item)
    return cuts


def kept(items: Sequence[Item], cut: int) -> list[Item]:
    """The items sent when those before `cut` are dropped: its instructions stay."""
    return [item for item in items[:cut] if _instruction(item)] + list(items[cut:])


async def fit(
    instructions: str | None,
    items: Sequence[Item],
    count: PromptCount,
    max_context: int,
    room: int,
    counted: int | None = None,
) -> Fitted:
    """The prompt of `instructions` and `items` that fits `max_context` with `room`
    tokens for the answer, items dropped from the beginning as the module says
    (`counted`: the whole prompt's tokens, where they were counted already); a
    `TooLong` where even the least it keeps fills the context."""
    messages = prompt_messages(instructions, items)
    tokens = await count(messages) if counted is None else counted
    limit = max_context - room
    if tokens <= limit:
        return Fitted(messages, tokens, 0, 1)
    cuts = cut_points(items)
    if not cuts:
        return _sent(Fitted(messages, tokens, 0, 1), max_context)
    weights = [_weight(item) for item in items]
    dropped_weight = [0] * (len(items) + 1)
    for i, weight in enumerate(weights):
        dropped_weight[i + 1] = dropped_weight[i] + weight
    # the tokens per character: at first the whole prompt's, then the two last counts'
    rate = tokens / max(1, dropped_weight[-1] + len(instructions or ""))
    at, at_weight, at_tokens = -1, 0, tokens  # the latest cut counted (-1: none)
    counts = 1
    while True:
        if counts == MAX_COUNTS - 1:
            j = len(cuts) - 1  # the estimates did not find it: the last user turn alone
        else:
            target = at_weight + (at_tokens - limit) / rate
            j = next(
                (k for k in range(at + 1, len(cuts)) if dropped_weight[cuts[k]] >= target),
                len(cuts) - 1,
            )
        sent = kept(items, cuts[j])
        messages = prompt_messages(instructions, sent)
        tokens = await count(messages)
        counts += 1
        fitted = Fitted(messages, tokens, len(items) - len(sent), counts)
        if tokens <= limit:
            return fitted
        if j == len(cuts) - 1:
            return _sent(fitted, max_context)
        weight = dropped_weight[cuts[j]]
        if at_tokens > tokens and weight > at_weight:
            rate = (at_tokens - tokens) / (weight - at_weight)
        at, at_weight, at_tokens = j, weight, tokens


def _sent(fitted: Fitted, max_context: int) -> Fitted:
    """The least that truncation keeps: sent where it leaves a token of the context (the
    answer cut to what it leaves), else vLLM's refusal, naming `input`."""
    if fitted.tokens < max_context:
        return fitted
    raise errors.TooLong(
        f"This model's maximum context length is {max_context} tokens. However, your "
        f"input contains {fitted.tokens} tokens even with 'truncation' of 'auto', which "
        "keeps the instructions and the last user message with the items after it. "
        "Please reduce the length of the input.",
        param="input",
    )
