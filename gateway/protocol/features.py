"""What a model's workers can serve beyond plain text generation, by the OpenAI
parameter names (the worker protocol's `ModelInfo.features`; what is a route
rather than a parameter by the route's name: `generate`, `embeddings`, and
`tokenize` for vLLM's /tokenize and /detokenize), and which of those a request
uses.

The gateway refuses a request that uses a feature its model's workers do not
list before it calls one (a 400 naming the parameter), and sets the protocol's
additive fields only for workers that list them, so a first-version worker,
which lists nothing, never sees a field it would silently drop.
"""

from __future__ import annotations

from operator import attrgetter

from gateway.protocol.types import GenerateRequest

GENERATE = "generate"
EMBEDDINGS = "embeddings"
#: Embeddings' chat form (vLLM's `messages` on /v1/embeddings): conversations rendered by
#: the model's chat template. Not the worker protocol's: `Embed` takes texts and ids.
EMBEDDING_CHAT = "embeddings.messages"
#: vLLM's /tokenize and /detokenize: the worker answers the protocol's Tokenize and
#: Detokenize (the prompt's ids as CountTokens counts them; ids decoded).
TOKENIZE = "tokenize"
N = "n"
LOGPROBS = "logprobs"
TOOLS = "tools"  # with tool_choice and parallel_tool_calls
RESPONSE_FORMAT = "response_format"
#: vLLM's structured outputs beyond JSON (the worker protocol's ResponseFormat types).
STRUCTURED_REGEX = "structured_outputs.regex"
STRUCTURED_CHOICE = "structured_outputs.choice"
STRUCTURED_GRAMMAR = "structured_outputs.grammar"
STRUCTURED = frozenset({STRUCTURED_REGEX, STRUCTURED_CHOICE, STRUCTURED_GRAMMAR})
#: A ResponseFormat's type → the feature it needs.
_FORMATS = {
    "json_object": RESPONSE_FORMAT,
    "json_schema": RESPONSE_FORMAT,
    "regex": STRUCTURED_REGEX,
    "choice": STRUCTURED_CHOICE,
    "grammar": STRUCTURED_GRAMMAR,
}
IMAGES = "image_url"
#: Sounds in a chat's messages (OpenAI's `input_audio` parts, vLLM's `audio_url`) and
#: videos (vLLM's `video_url`): only OpenAI-compatible servers take them; the worker
#: protocol and vLLM's gRPC server have no field for one.
AUDIO = "input_audio"
VIDEO = "video_url"
#: The content parts only OpenAI-compatible servers take → the feature each needs.
RELAYED_PARTS = {"input_audio": AUDIO, "audio_url": AUDIO, "video_url": VIDEO}
#: The generation features only OpenAI-compatible servers take.
RELAYED = frozenset(RELAYED_PARTS.values())
#: What no worker of the worker protocol is taken to serve, whatever it lists.
NOT_CARRIED = RELAYED | {EMBEDDING_CHAT}
MIN_TOKENS = "min_tokens"
IGNORE_EOS = "ignore_eos"
REPETITION_PENALTY = "repetition_penalty"
MIN_P = "min_p"
LOGIT_BIAS = "logit_bias"
STOP_TOKEN_IDS = "stop_token_ids"
USER = "user"
DIMENSIONS = "dimensions"
#: vLLM's reasoning parameters (the worker protocol's `ReasoningOptions`).
REASONING_EFFORT = "reasoning_effort"
INCLUDE_REASONING = "include_reasoning"
CHAT_TEMPLATE_KWARGS = "chat_template_kwargs"
THINKING_TOKEN_BUDGET = "thinking_token_budget"
REASONING = frozenset(
    {REASONING_EFFORT, INCLUDE_REASONING, CHAT_TEMPLATE_KWARGS, THINKING_TOKEN_BUDGET}
)

#: vLLM's chat parameters that end a chat's prompt another way than with the template's
#: generation prompt: none (`add_generation_prompt` false), or the last message left
#: open for the answer to continue (`continue_final_message`, Anthropic's prefill).
ADD_GENERATION_PROMPT = "add_generation_prompt"
CONTINUE_FINAL_MESSAGE = "continue_final_message"
CHAT_END = frozenset({ADD_GENERATION_PROMPT, CONTINUE_FINAL_MESSAGE})
#: vLLM's: the stop string that ends an answer kept at its end.
INCLUDE_STOP = "include_stop_str_in_output"
#: vLLM's: an answer's special tokens shown in its text (`skip_special_tokens: false`).
SKIP_SPECIAL_TOKENS = "skip_special_tokens"
#: vLLM's: the prompt cut to its last N tokens.
TRUNCATE_PROMPT_TOKENS = "truncate_prompt_tokens"
#: vLLM's: the answer carries the prompt's and its choices' token ids (the events'
#: `token_ids`, the `Started`'s `prompt_token_ids`).
RETURN_TOKEN_IDS = "return_token_ids"

#: Every feature a worker may list.
ALL = frozenset(
    {
        GENERATE,
        EMBEDDINGS,
        EMBEDDING_CHAT,
        TOKENIZE,
        N,
        LOGPROBS,
        TOOLS,
        RESPONSE_FORMAT,
        IMAGES,
        AUDIO,
        VIDEO,
        MIN_TOKENS,
        IGNORE_EOS,
        REPETITION_PENALTY,
        MIN_P,
        LOGIT_BIAS,
        STOP_TOKEN_IDS,
        USER,
        DIMENSIONS,
    }
    | REASONING
    | STRUCTURED
    | CHAT_END
    | {INCLUDE_STOP, SKIP_SPECIAL_TOKENS, TRUNCATE_PROMPT_TOKENS, RETURN_TOKEN_IDS}
)
#: vLLM's sampling fields beyond OpenAI's, which engines that sample with their own
#: code (vLLM, transformers) all take.
SAMPLING = frozenset(
    {MIN_TOKENS, IGNORE_EOS, REPETITION_PENALTY, MIN_P, LOGIT_BIAS, STOP_TOKEN_IDS}
)
#: What a worker that lists nothing (the protocol's first version) serves.
FIRST_VERSION = frozenset({GENERATE})


#: What `used` can find in a request: a model serving all of them serves any request.
OF_REQUESTS = frozenset(
    {N, LOGPROBS, TOOLS, RESPONSE_FORMAT, IMAGES, USER}
    | RELAYED
    | SAMPLING
    | REASONING
    | STRUCTURED
    | CHAT_END
    | {INCLUDE_STOP, SKIP_SPECIAL_TOKENS, TRUNCATE_PROMPT_TOKENS, RETURN_TOKEN_IDS}
)
#: A request's fields that say whether it uses a feature, and their values (and its
#: sampling's) where it uses none: most requests, seen in one comparison (in C) each.
_request_values = attrgetter(
    "n",
    "logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
    "user",
    "reasoning",
    "add_generation_prompt",
    "continue_final_message",
    "include_stop",
    "skip_special_tokens",
    "truncate_prompt_tokens",
    "return_token_ids",
)
_REQUEST_UNUSED = (1, None, (), "", None, None, "", None, True, False, False, True, None, False)
_sampling_values = attrgetter(
    "min_tokens", "ignore_eos", "repetition_penalty", "min_p", "logit_bias", "stop_token_ids"
)
_SAMPLING_UNUSED = (None, None, None, None, (), ())
_images = attrgetter("images")
_parts = attrgetter("parts")


def used(request: GenerateRequest) -> list[tuple[str, str]]:
    """The features `request` uses, each with the parameter a refusal names
    (e.g. ("image_url", "messages[2].content[0]")), in the body's order."""
    found: list[tuple[str, str]] = []
    if request.messages is not None and any(map(_parts, request.messages)):
        media = relayed_media(request)
        if media is not None:
            found.append(media)
    if request.messages is not None and any(map(_images, request.messages)):
        for i, message in enumerate(request.messages):
            if message.images:
                found.append((IMAGES, f"messages[{i}].content"))
                break
    if _request_values(request) != _REQUEST_UNUSED:
        if request.n != 1:
            found.append((N, "n"))
        if request.logprobs is not None:
            found.append((LOGPROBS, "logprobs"))
        if request.tools or request.tool_choice or request.parallel_tool_calls is not None:
            found.append((TOOLS, "tools"))
        answer = request.response_format
        if answer is not None:
            feature = _FORMATS.get(answer.type, RESPONSE_FORMAT)
            # vLLM's types come from `structured_outputs`, a request's field of that name
            found.append((feature, feature if feature in STRUCTURED else RESPONSE_FORMAT))
        if request.user:
            found.append((USER, "user"))
        if request.continue_final_message:
            found.append((CONTINUE_FINAL_MESSAGE, CONTINUE_FINAL_MESSAGE))
        elif not request.add_generation_prompt:
            found.append((ADD_GENERATION_PROMPT, ADD_GENERATION_PROMPT))
        if request.include_stop:
            found.append((INCLUDE_STOP, INCLUDE_STOP))
        if not request.skip_special_tokens:
            found.append((SKIP_SPECIAL_TOKENS, SKIP_SPECIAL_TOKENS))
        if request.truncate_prompt_tokens is not None:
            found.append((TRUNCATE_PROMPT_TOKENS, TRUNCATE_PROMPT_TOKENS))
        if request.return_token_ids:
            found.append((RETURN_TOKEN_IDS, RETURN_TOKEN_IDS))
        reasoning = request.reasoning
        if reasoning is not None:
            for name, used_ in (
                (REASONING_EFFORT, reasoning.effort),
                (INCLUDE_REASONING, not reasoning.include),
                (CHAT_TEMPLATE_KWARGS, reasoning.template_kwargs),
                (THINKING_TOKEN_BUDGET, reasoning.budget is not None),
            ):
                if used_:
                    found.append((name, name))
    if _sampling_values(request.sampling) != _SAMPLING_UNUSED:
        s = request.sampling
        for name, value in (
            (MIN_TOKENS, s.min_tokens),
            (IGNORE_EOS, s.ignore_eos),
            (REPETITION_PENALTY, s.repetition_penalty),
            (MIN_P, s.min_p),
            (LOGIT_BIAS, s.logit_bias or None),
            (STOP_TOKEN_IDS, s.stop_token_ids or None),
        ):
            if value is not None:
                found.append((name, name))
    return found


def relayed_media(request: GenerateRequest) -> tuple[str, str] | None:
    """The first content part of `request`'s messages that only OpenAI-compatible servers
    take (a sound, a video): its feature, and the part as a refusal names it
    (`messages[i].content[j]`); None when there is none."""
    for i, message in enumerate(request.messages or ()):
        for j, part in enumerate(message.parts):
            feature = RELAYED_PARTS.get(part.type)
            if feature is not None:
                return feature, f"messages[{i}].content[{j}]"
    return None


def missing(request: GenerateRequest, served: frozenset[str]) -> tuple[str, str] | None:
    """The first feature `request` uses that `served` lacks, with its parameter; None if none."""
    if served >= OF_REQUESTS:  # OpenAI-compatible upstreams list them all
        return None
    for pair in used(request):
        if pair[0] not in served:
            return pair
    return None


def missing_chat_end(request: GenerateRequest, served: frozenset[str]) -> tuple[str, str] | None:
    """`missing` for a count or a tokenization of the request's prompt, which asks
    nothing of the answer: whether its workers can end the chat as it asks."""
    if served >= CHAT_END or (request.add_generation_prompt and not request.continue_final_message):
        return None
    return next((p for p in used(request) if p[0] in CHAT_END and p[0] not in served), None)
