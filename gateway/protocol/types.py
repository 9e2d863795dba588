"""Our own request and event types: what the layers pass between them.

The edge builds a `GenerateRequest` from an OpenAI body; the engine client turns
it into protobuf and the worker's protobuf events back into these events; the
worker SDK hands the same types to engines. Events are small tuples because
one is made for every message a worker sends.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from itertools import compress, repeat
from operator import attrgetter, is_not
from typing import Any, NamedTuple


class FinishReason(enum.Enum):
    """Why an answer ended; the values are OpenAI's `finish_reason`."""

    STOP = "stop"
    LENGTH = "length"
    TOOL_CALLS = "tool_calls"


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call of a tool: in an assistant message of the conversation."""

    id: str
    name: str
    arguments: str  # JSON text


@dataclass(frozen=True, slots=True)
class Tool:
    """A function the model may call."""

    name: str
    description: str = ""
    parameters: str = ""  # a JSON Schema in JSON text; "": no parameters
    strict: bool = False


@dataclass(frozen=True, slots=True)
class ResponseFormat:
    """A format the answer must follow: "json_object", "json_schema" with its schema, or
    one of vLLM's structured outputs: "regex", "choice", "grammar" (EBNF)."""

    type: str
    schema: str = ""  # JSON text, for "json_schema"
    name: str = ""
    strict: bool = False
    regex: str = ""
    choice: tuple[str, ...] = ()
    grammar: str = ""


@dataclass(frozen=True, slots=True)
class ContentPart:
    """One part of a message's content as the client wrote it: a text, an image (a URL
    or data URI, with its `detail`: "auto", "low", "high", or "" when not given), or a
    sound: OpenAI's `input_audio` (base64 `data` in a `format`: "wav", "mp3") or vLLM's
    `audio_url` (a URL or data URI, in `url`), or a video: vLLM's `video_url` (in `url`)."""

    type: str  # "text", "image_url", "input_audio", "audio_url" or "video_url"
    text: str = ""
    url: str = ""
    detail: str = ""
    data: str = ""
    format: str = ""


@dataclass(frozen=True, slots=True)
class Message:
    """One chat message, its text parts already joined; its images (URLs or
    data URIs) in order. `parts`, when the content was a list holding an image, a sound
    or a video, is that list as it came (order and `detail` kept), for whoever sends it on
    as parts; `content` and `images` say the same for whoever reads only those (a sound or
    a video is in `parts` alone: only OpenAI-compatible servers take one)."""

    role: str
    content: str
    images: tuple[str, ...] = ()
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""
    name: str = ""
    parts: tuple[ContentPart, ...] = ()
    #: An assistant message's reasoning, sent back by the client (vLLM's `reasoning`):
    #: the chat templates of models that think between tool calls render it.
    reasoning: str = ""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Sampling settings; None means the engine's default."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    max_tokens: int | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), sorted by id
    stop_token_ids: tuple[int, ...] = ()

    def given(self) -> dict[str, Any]:
        """The settings above that are None unless set, by name: those that are set."""
        # in C, with no Python loop: it runs for every request sent to a worker
        values = _optional_values(self)
        is_set = map(is_not, values, repeat(None))
        return dict(compress(zip(OPTIONAL_SAMPLING, values, strict=True), is_set))


#: SamplingParams' settings that are None where the client set nothing.
OPTIONAL_SAMPLING = (
    "temperature",
    "top_p",
    "top_k",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "max_tokens",
    "min_tokens",
    "ignore_eos",
    "repetition_penalty",
    "min_p",
)
_optional_values = attrgetter(*OPTIONAL_SAMPLING)


@dataclass(frozen=True, slots=True)
class ReasoningParams:
    """vLLM's reasoning parameters, which a reasoning model's chat template and its
    server's reasoning parser read; each at the value that asks nothing by default."""

    #: How hard it thinks ("": the model's default).
    effort: str = ""
    #: Whether its reasoning is sent (vLLM's `include_reasoning`).
    include: bool = True
    #: The chat template's own arguments, such as `enable_thinking` (a JSON object's
    #: text; "": none).
    template_kwargs: str = ""
    #: The most tokens it may think (vLLM's `thinking_token_budget`); None: no bound.
    budget: int | None = None
    #: Thinking turned off (Anthropic's `thinking: disabled`), as vLLM's Messages server
    #: turns it off: effort "none" for the workers that take an effort; a hint the others,
    #: which take none, pass over (their answers' thinking is left out all the same).
    off: bool = False


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """One request for `n` answers (choices): a text prompt or chat messages,
    never both. Fields past `request_id` are the additive ones of the worker
    protocol: see `gateway.protocol.features` for which parameter each is."""

    model: str
    prompt: str | None = None
    messages: tuple[Message, ...] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    request_id: str = ""
    n: int = 1
    logprobs: int | None = None  # alternatives per token (0-20); None: no logprobs
    tools: tuple[Tool, ...] = ()
    tool_choice: str = ""  # "none", "auto", "required", a function's name; "": default
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    user: str = ""
    #: vLLM's reasoning parameters; None: none given (most requests).
    reasoning: ReasoningParams | None = None
    #: The conversation this request continues, for session affinity only (never sent to a
    #: worker): the body's `prompt_cache_key`, a route's own key (the Responses API's
    #: `previous_response_id`) or the `x-session-id` header; "": none, and the fleet falls
    #: back to `user`.
    session: str = ""
    #: Where a prefill worker left the prompt's KV cache, as it said (vLLM's
    #: `kv_transfer_params`, a JSON object's text), for the decode worker to pull
    #: (`models[].prefill_workers`: set by the fleet, never by a client); "": none.
    kv_transfer: str = ""
    #: How a chat's prompt ends (vLLM's chat parameters): with the template's generation
    #: prompt (the default), without it, or `continue_final_message`: cut after the last
    #: message's text, which the answer goes on from (a prefill: Anthropic's final
    #: assistant message). Never both.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    #: vLLM's `include_stop_str_in_output`: the stop string that ends a choice ends its
    #: text too (it is left out otherwise).
    include_stop: bool = False
    #: vLLM's `skip_special_tokens`: an answer's special tokens left out of its text (the
    #: default), or shown (an end of sequence never is).
    skip_special_tokens: bool = True
    #: vLLM's `truncate_prompt_tokens`: the prompt keeps only its last N tokens (-1: as
    #: many as the context leaves beside `max_tokens`); None: all of it.
    truncate_prompt_tokens: int | None = None
    #: vLLM's `return_token_ids`: the events carry the token ids (the prompt's on
    #: `Started`, each piece's on its event, the rest on `Finished`), for the answer.
    return_token_ids: bool = False


#: Token ids on an event: None where the request did not ask for them (the usual).
TokenIds = tuple[int, ...] | None


@dataclass(frozen=True, slots=True)
class ChatForm:
    """The chat form of an embeddings request (vLLM's): conversations instead of inputs,
    each rendered by the model's chat template and embedded as one input, with the
    template's options as vLLM's server takes them."""

    conversations: tuple[tuple[Message, ...], ...]
    #: `messages` was a list of conversations (vLLM's batched form), not one.
    batched: bool = False
    add_generation_prompt: bool = False
    #: The last message left open (its end cut after its content), as for a prefill.
    continue_final_message: bool = False
    #: Special tokens (the BOS) added on top of what the template writes.
    add_special_tokens: bool = False
    #: The chat template's own arguments (a JSON object's text; "": none).
    template_kwargs: str = ""


@dataclass(frozen=True, slots=True)
class EmbedRequest:
    """Inputs to embed, each a text or token ids; or, in the chat form (`chat`),
    conversations, and no inputs."""

    model: str
    inputs: tuple[str | tuple[int, ...], ...]
    dimensions: int | None = None
    user: str = ""
    request_id: str = ""
    chat: ChatForm | None = None

    @property
    def count(self) -> int:
        """The vectors its answer holds: one an input, or one a conversation."""
        return len(self.inputs) if self.chat is None else len(self.chat.conversations)


@dataclass(frozen=True, slots=True)
class Embeddings:
    """One vector per input, in order, and the tokens the inputs held."""

    vectors: tuple[tuple[float, ...], ...]
    prompt_tokens: int


@dataclass(frozen=True, slots=True)
class RerankRequest:
    """A query and the documents a cross-encoder scores against it."""

    model: str
    query: str
    documents: tuple[str, ...]
    user: str = ""
    request_id: str = ""


@dataclass(frozen=True, slots=True)
class Classification:
    """A classifier's answer for one input: its label (None: the model names none) and
    each class's probability."""

    label: str | None
    probs: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class Classifications:
    """One classification per input, in order, and the tokens the inputs held."""

    items: tuple[Classification, ...]
    prompt_tokens: int


@dataclass(frozen=True, slots=True)
class AudioRequest:
    """Speech to write down (OpenAI's audio routes): a transcription in the speech's own
    language, or a translation into English; the audio file as the client sent it, and
    the form's other fields, checked, as they go to the server."""

    model: str
    translate: bool
    audio: bytes
    filename: str
    content_type: str
    fields: tuple[tuple[str, str], ...] = ()
    stream: bool = False
    request_id: str = ""


@dataclass(frozen=True, slots=True)
class Transcript:
    """A speech-to-text answer: whole, its body and type as the server made them (for a
    stream, empty: its text went out as it came), the text, and the tokens the server
    said it read and wrote (0 where it says none: a duration is not tokens)."""

    body: bytes
    content_type: str
    text: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0


#: The largest token id (the worker protocol's ids are uint32).
TOKEN_ID_MAX = 2**32 - 1


@dataclass(frozen=True, slots=True)
class Tokens:
    """A prompt's token ids (vLLM's `/tokenize`), and each one's string when asked."""

    ids: list[int]
    #: The tokenizer's own string of each id (None: not asked).
    strs: list[str] | None = None


@dataclass(frozen=True, slots=True)
class Scores:
    """A relevance score per pair (per document of a `RerankRequest`), in order, and the
    tokens the pairs held."""

    values: tuple[float, ...]
    prompt_tokens: int


#: What a pooling model's workers answer: vectors, scores of pairs, or classes.
Pooling = Embeddings | Scores | Classifications


class Started(NamedTuple):
    """First event: the worker accepted the request; how many of the prompt's tokens
    its engine found in its prefix cache (0: none, or it does not say)."""

    prompt_tokens: int
    cached_tokens: int = 0
    #: The prompt's ids as the engine runs them (`return_token_ids` only).
    prompt_token_ids: TokenIds = None


class TokenLogprob(NamedTuple):
    """One generated token's log probability and the most likely alternatives
    at its position (token, logprob), most likely first."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


class Text(NamedTuple):
    """A piece of choice `index`'s answer holding `tokens` tokens; with
    `logprobs` when asked for, one per token."""

    text: str
    tokens: int
    index: int = 0  # type: ignore[assignment]  # shadows tuple.index, as meant
    logprobs: tuple[TokenLogprob, ...] | None = None
    #: The ids of its tokens (`return_token_ids` only), a stop string's cut from it too.
    token_ids: TokenIds = None


class Reasoning(NamedTuple):
    """A piece of choice `index`'s reasoning holding `tokens` tokens: the text a
    reasoning model thinks before its answer, which its server parses apart from the
    answer (vLLM's `reasoning`, with `--reasoning-parser`)."""

    text: str
    tokens: int
    index: int = 0  # type: ignore[assignment]  # shadows tuple.index, as meant
    token_ids: TokenIds = None  # `return_token_ids` only


class ToolCallDelta(NamedTuple):
    """A piece of tool call `call_index` of choice `index`: its first piece has
    the id and name, the next ones more of the arguments' JSON text."""

    index: int  # type: ignore[assignment]  # shadows tuple.index, as meant
    call_index: int
    id: str
    name: str
    arguments: str
    tokens: int = 0
    token_ids: TokenIds = None  # `return_token_ids` only


class Finished(NamedTuple):
    """Last event of choice `index`: why its answer ended and how many tokens it
    took; the prompt's tokens too when the worker could not say them in `Started`
    (HTTP upstreams), and the prompt's cached tokens when it learnt them only at the end
    (None: `Started` said them). A call ends after the Finished of each of its n choices."""

    reason: FinishReason
    completion_tokens: int
    prompt_tokens: int | None = None
    index: int = 0  # type: ignore[assignment]  # shadows tuple.index, as meant
    #: The stop string that ended the choice (reason STOP); "": the model ended it.
    stop_sequence: str = ""
    cached_tokens: int | None = None
    #: The ids of the choice's tokens no earlier event carried (the end of sequence it
    #: ended with), `return_token_ids` only: its events' ids joined are all its ids.
    token_ids: TokenIds = None


def turn_counts(started: Started, finished: Finished) -> tuple[int, int]:
    """A call's prompt and cached tokens: an upstream that counts the prompt only at the
    end (OpenAI-compatible servers) says it in `finished`, and the end's count wins."""
    prompt, cached = finished.prompt_tokens, finished.cached_tokens
    return (
        started.prompt_tokens if prompt is None else prompt,
        started.cached_tokens if cached is None else cached,
    )


Event = Started | Text | Reasoning | ToolCallDelta | Finished
