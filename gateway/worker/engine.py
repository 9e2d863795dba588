"""The interface a model runtime implements to become a worker."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Collection, Sequence
from typing import Any

from gateway.protocol import errors, features
from gateway.protocol.errors import Invalid, TooLong
from gateway.protocol.grpc_options import MAX_MESSAGE_BYTES
from gateway.protocol.reasoning import template_options
from gateway.protocol.types import Embeddings, EmbedRequest, Event, GenerateRequest
from gateway.worker.kv_events import KvPublisher


class Engine(ABC):
    """A model runtime, as the worker SDK drives it.

    `generate` yields `Started` first (the prompt's tokens, and those its prefix
    cache held where the engine knows them: the SDK passes them on), then `Text`
    pieces (with `logprobs`, one per token, when the request asks for them) and
    `ToolCallDelta`s (a call's id and name first, then its arguments' JSON in
    pieces), then `Finished` (`TOOL_CALLS` after calls). It refuses a request by raising an
    `GatewayError` (`TooLong`, `Invalid`, `Busy`, ...) before yielding `Started`.
    When the call is cancelled, the SDK closes the generator (CancelledError or
    GeneratorExit at its current `await`/`yield`): free the request's resources
    in a `finally`. Stop strings are the SDK's job; `max_tokens` and the context
    are the engine's. A field the engine does not list in `features` never
    reaches it: the SDK refuses the request naming the parameter.
    """

    #: The model name requests use.
    model: str
    #: Prompt plus completion tokens the model holds.
    max_context: int
    #: Requests it runs at once; the SDK refuses more with RESOURCE_EXHAUSTED.
    capacity: int = 256
    #: What it serves beyond plain generation (`gateway.protocol.features`), for
    #: `Describe`; the SDK refuses a request using anything else, naming the
    #: parameter. The SDK adds "n" itself: it runs n generations of n=1 and
    #: indexes their events, unless the engine sets `native_n` (then `generate`
    #: gets n and indexes its own events, one Finished per choice).
    features: frozenset[str] = features.FIRST_VERSION
    native_n: bool = False

    @abstractmethod
    def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        """The events of one answer."""

    async def embed(self, request: EmbedRequest) -> Embeddings:
        """Embeds the inputs (engines that list "embeddings")."""
        raise errors.Invalid(f"The model `{self.model}` does not serve embeddings.", param="model")

    async def count_tokens(self, request: GenerateRequest) -> int:
        """The tokens of the prompt `generate` would make of `request` (its text, or its
        messages and tools through the template), by the engine's own tokenizer."""
        raise errors.CannotCount(f"The model `{self.model}` does not count tokens.", param="model")

    # vLLM's /tokenize and /detokenize (the protocol's Tokenize and Detokenize), served
    # by an engine that lists "tokenize": the SDK refuses them naming `model` for any
    # other, and bounds what reaches the engine and what goes back (`MAX_DETOKENIZE_IDS`,
    # `MAX_DETOKENIZED_CHARS`, a reply within one message).

    async def tokenize(self, request: GenerateRequest) -> list[int]:
        """The ids of the prompt `generate` would make of `request`, in order: those
        `count_tokens` counts (its text, or its messages and tools through the chat
        template with the generation prompt); refusals as `count_tokens`'."""
        raise errors.CannotCount(f"The model `{self.model}` does not tokenize.", param="model")

    async def token_strs(self, ids: Sequence[int]) -> list[str]:
        """Each id's string, the tokenizer's own piece (a Hugging Face tokenizer's
        `convert_ids_to_tokens`), one per id; called with ids `tokenize` gave."""
        raise errors.CannotCount(f"The model `{self.model}` does not tokenize.", param="model")

    async def detokenize(self, ids: Sequence[int]) -> str:
        """The text `ids` decode to by the model's tokenizer, special tokens kept (vLLM's
        /detokenize: `tokenizer.decode(ids)`); an id outside the vocabulary is `Invalid`
        naming "tokens", and so is a text past `MAX_DETOKENIZED_CHARS` where the engine
        can tell before it decodes."""
        raise errors.CannotCount(f"The model `{self.model}` does not tokenize.", param="model")

    # LoRA adapters of `model`, each served under its own name (`LoadAdapter`): an
    # engine that takes them sets `takes_adapters` and overrides the two below; the SDK
    # checks a request's name and path (`check_adapter`) before `load_adapter` sees it,
    # lists `adapters()` in `Describe` and lets a request name one of them (the engine
    # runs it with that adapter). By default none: LoadAdapter is UNIMPLEMENTED.

    #: It loads LoRA adapters (`load_adapter`).
    takes_adapters: bool = False

    def adapters(self) -> Collection[str]:
        """The adapters it serves now, by name (called for every request: keep it cheap)."""
        return ()

    async def load_adapter(self, name: str, path: str) -> None:
        """Loads the adapter at `path` (a folder on this machine) as `name`; one it
        holds already from the same path is loaded. Raises `Invalid` when it cannot
        (no adapter there, one its engine refuses, no room): the worker answers
        FAILED_PRECONDITION, the operator's to fix; `Unavailable` while not up."""
        raise errors.Invalid(f"The model `{self.model}` takes no adapters.", param="path")

    def kv_events(self) -> KvPublisher | None:
        """Its KV-cache events for `SubscribeKvEvents` (`gateway.worker.kv_events`), so
        gateways route by what it holds; None: it publishes none (UNIMPLEMENTED)."""
        return None

    # The life of an engine that comes up after its worker listens (vLLM loads for
    # seconds to minutes): the worker reports NOT_SERVING until `start` returns and
    # once `wait_dead` does. Engines that are up when constructed keep the defaults.

    async def start(self) -> None:
        """Brings the engine up; by default it is up already."""
        return

    async def wait_dead(self) -> None:
        """Returns when the engine has died for good; by default never."""
        await asyncio.get_running_loop().create_future()

    async def shutdown(self) -> None:
        """Frees the engine once its worker has stopped; by default nothing."""
        return

    def load(self) -> int | None:
        """Requests running in the engine by its own count, for `Describe`; None:
        the worker counts the calls it is serving."""
        return None


#: The most ids one Detokenize call takes (refused naming "tokens" before the engine sees
#: them): past any context served but the very longest, and ~5 MB of varints on the wire.
MAX_DETOKENIZE_IDS = 1 << 20
#: The longest text a Detokenize reply carries, in characters (refused naming "tokens"):
#: at most 32 MiB of UTF-8, well within one message.
MAX_DETOKENIZED_CHARS = 1 << 23
#: The largest Tokenize reply (its ids and strings), in bytes: what one message carries;
#: a prompt whose tokens pass it is refused naming the prompt's parameter.
MAX_TOKENIZE_REPLY = MAX_MESSAGE_BYTES

#: The longest adapter name a worker takes (a model name's length, with room).
MAX_ADAPTER_NAME = 256
#: The longest adapter path a worker takes (Linux's PATH_MAX).
MAX_ADAPTER_PATH = 4096


def check_adapter(name: str, path: str) -> None:
    """Refuses a `LoadAdapter` request out of bounds (`Invalid` naming `name` or `path`),
    before any engine reads it: a client names what the worker serves and which of its
    files it reads, so both are bounded here; the path must be absolute (a relative one
    would depend on the worker's working folder)."""
    if (
        not 0 < len(name) <= MAX_ADAPTER_NAME
        or not name.isprintable()
        or any(c.isspace() for c in name)
    ):
        raise Invalid(
            f"An adapter's name is 1 to {MAX_ADAPTER_NAME} printable characters, no spaces.",
            param="name",
        )
    if not 0 < len(path) <= MAX_ADAPTER_PATH or not path.isprintable() or not path.startswith("/"):
        raise Invalid(
            f"An adapter's path is an absolute path of at most {MAX_ADAPTER_PATH} characters.",
            param="path",
        )


def kept_tokens(request: GenerateRequest, max_context: int) -> int | None:
    """How many of its prompt's last tokens a request keeps (vLLM's
    `truncate_prompt_tokens`, which cuts a generation's prompt from its start): N, or
    for -1 what the context leaves beside `max_tokens` (at least a token to answer);
    None: all of them."""
    keep = request.truncate_prompt_tokens
    if keep is None or keep > 0:
        return keep
    return max(1, max_context - (request.sampling.max_tokens or 1))


def truncated(ids: list[int], request: GenerateRequest, max_context: int) -> list[int]:
    """The prompt's ids cut to the last ones the request keeps (`kept_tokens`)."""
    keep = kept_tokens(request, max_context)
    return ids if keep is None or len(ids) <= keep else ids[-keep:]


def check_context(request: GenerateRequest, prompt_tokens: int, max_context: int) -> int:
    """How many tokens the answer may take: `max_tokens` (unset: the rest of the
    context) clamped to what the prompt leaves of `max_context`, as vLLM 0.32's
    server does (`TokenizeParams` refuses, `get_max_tokens` clamps).

    Why not the older rule (prompt plus `max_tokens` within the context): agents
    send a `max_tokens` of 32k-128k on every request, so a long conversation was
    refused where vLLM serves it, its answer cut at the context ("length").

    Refused, in vLLM's words: `max_tokens` above the context, as `Invalid` naming
    `max_tokens` (the worker does not know whether chat's client called it
    `max_completion_tokens`); a prompt longer than the context, as `TooLong`; a
    prompt that fills it, leaving no token to answer, as `TooLong` too (vLLM
    refuses it as well, with "max_tokens must be at least 1, got 0").
    """
    max_tokens = request.sampling.max_tokens
    if max_tokens is not None and max_tokens > max_context:
        raise Invalid(
            f"max_tokens={max_tokens} cannot be greater than max_model_len={max_context}. "
            "Please request fewer output tokens.",
            param="max_tokens",
        )
    param = "messages" if request.messages is not None else "prompt"
    if prompt_tokens >= max_context:
        exceeds = (
            "which exceeds this limit even without any output tokens"
            if prompt_tokens > max_context
            else "which leaves no room for any output tokens"
        )
        raise TooLong(
            f"This model's maximum context length is {max_context} tokens. However, your "
            f"prompt contains {prompt_tokens} input tokens, {exceeds}. Please reduce the "
            "length of the input prompt.",
            param=param,
        )
    budget = max_context - prompt_tokens
    return budget if max_tokens is None else min(budget, max_tokens)


#: `apply_chat_template`'s own arguments (transformers'), which the engines set: a
#: client's template variable of one of these names is left out, as vLLM's server lets
#: its own win (and passing it twice would be a TypeError).
_TEMPLATE_ARGUMENTS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "processor_kwargs",
    }
)


def template_kwargs(request: GenerateRequest) -> dict[str, Any]:
    """The chat template's variables a request's reasoning options set (vLLM's
    `chat_template_kwargs` and `reasoning_effort`: `template_options`), as keyword
    arguments for a Hugging Face tokenizer's `apply_chat_template`, which hands them to
    the template; {} for a request with none."""
    reasoning = request.reasoning
    options = None if reasoning is None else template_options(reasoning)
    if not options:
        return {}
    return {k: v for k, v in options.items() if k not in _TEMPLATE_ARGUMENTS}


def chat_end(request: GenerateRequest) -> dict[str, Any]:
    """How the chat template ends the request's prompt, as `apply_chat_template`'s
    arguments (and vLLM's renderer's): after the generation prompt (the default), without
    it, or inside the last message, left open for the answer to continue
    (`continue_final_message`, which transformers takes only without the other)."""
    open_end = request.continue_final_message
    return {
        "add_generation_prompt": request.add_generation_prompt and not open_end,
        "continue_final_message": open_end,
    }


def chat_end_refused(request: GenerateRequest, error: ValueError) -> Invalid:
    """A chat template's refusal to leave the last message open (transformers raises a
    ValueError when the rendered chat does not hold that message's text as it is)."""
    param = "continue_final_message" if request.continue_final_message else "messages"
    return Invalid(f"The chat template refused the messages: {error}", param=param)
