"""Turns an OpenAI request body into our `GenerateRequest`, or a 400 naming the
parameter at fault, with the rules OpenAI-compatible servers apply.

Every parameter of OpenAI's and vLLM's chat and completions APIs is either
served (parsed here, carried to the worker, refused by the route when the
model's workers lack its feature) or refused here by name (`UNSERVED`); a
parameter at its default value is accepted, since obeying it costs nothing.
Unknown fields are ignored, as OpenAI-compatible servers ignore them, so SDKs
sending extras keep working. Whether the model's workers serve a parameter is
the route's check (`gateway.protocol.features`), after the model is resolved.

This runs for every request, and most bodies give few of the parameters: a
parameter's check is called only where the body has it (an `in` is a fraction
of a call), in a fixed order, so a body with two faults is always refused for
the same one.
"""

from __future__ import annotations

import binascii
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, ClassVar, TypeGuard

import orjson

from gateway.edge.errors import invalid
from gateway.edge.openai.schema_limits import SchemaBudget
from gateway.protocol.features import RELAYED_PARTS
from gateway.protocol.types import (
    ContentPart,
    GenerateRequest,
    Message,
    ReasoningParams,
    ResponseFormat,
    SamplingParams,
    Tool,
    ToolCall,
)

MAX_STOP = 4
#: The longest stop string, in characters: a worker holds back that much text.
MAX_STOP_CHARS = 1024
UINT32_MAX = 2**32 - 1  # the worker protocol's counts are uint32
INT32_MAX = 2**31 - 1  # and its signed fields (truncate_prompt_tokens) int32
ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
#: Bounds on what one request may ask of the new fields (OpenAI's where it has one).
MAX_N = 128
MAX_LOGPROBS = 20  # vLLM's default max_logprobs; OpenAI's top_logprobs cap
MAX_TOOLS = 128
MAX_TOOL_CALLS = 128  # per assistant message
MAX_LOGIT_BIAS = 1024
MAX_STOP_TOKEN_IDS = 256
MAX_IMAGES = 64
#: Sounds and videos (the parts only OpenAI-compatible servers take) a request may hold.
MAX_MEDIA = 64
MAX_USER_CHARS = 256
#: vLLM's `reasoning_effort` values (OpenAI's, and DeepSeek's "max").
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
#: The most JSON text `chat_template_kwargs` may take.
MAX_TEMPLATE_KWARGS_BYTES = 16 * 1024
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
#: Image references a worker may take: web URLs and inline data.
_IMAGE_URL = re.compile(r"(https?://|data:image/)", re.I)
#: Sound and video references (vLLM's `audio_url` and `video_url`): web URLs and inline
#: data of their kind.
_MEDIA_URLS = {
    "audio_url": re.compile(r"(https?://|data:audio/)", re.I),
    "video_url": re.compile(r"(https?://|data:video/)", re.I),
}
#: An `input_audio` part's format: a media subtype (OpenAI's "wav" and "mp3"; vLLM
#: decodes what the bytes are, the format only names their type).
_AUDIO_FORMAT = re.compile(r"[a-z0-9][a-z0-9.+-]{0,31}", re.I)

#: Parameters of OpenAI's or vLLM's APIs this gateway does not serve, with the
#: value that asks nothing of it (None: any value but null is refused).
UNSERVED: dict[str, Any] = {
    "functions": None,  # the deprecated form of tools
    "function_call": None,
    "audio": None,
    "modalities": None,
    "prediction": None,
    "web_search_options": None,
    "moderation": None,  # OpenAI's moderation of the input and the output
    # OpenAI's prompt caching: the engines cache every prefix in memory by themselves
    "prompt_cache_retention": "in_memory",
    "prompt_cache_options": None,
    "guided_json": None,  # vLLM's older structured-output fields: use structured_outputs
    "guided_regex": None,
    "guided_choice": None,
    "guided_grammar": None,
    "prompt_logprobs": None,
    "allowed_token_ids": None,
    "bad_words": None,
    "chat_template": None,
    "use_beam_search": False,
    "length_penalty": None,
    # more of vLLM's: what they ask changes the answer or how the engine runs it
    "return_tokens_as_token_ids": False,
    "spaces_between_special_tokens": True,
    "guided_decoding_backend": None,
    "guided_whitespace_pattern": None,
    "logits_processors": None,
    "documents": None,
    "mm_processor_kwargs": None,
    "cache_salt": None,
    "kv_transfer_params": None,
    "vllm_xargs": None,
    "priority": 0,  # the gateway's own is the x-furnace-priority header
    # vLLM 0.32's newer options: ids, multimodal, transfer, detection and output extras
    "request_id": None,  # the gateway's id is its own (x-request-id)
    "session_id": None,
    "watermarking": None,
    "truncation_side": None,
    "logprob_token_ids": None,
    "media_io_kwargs": None,
    "mm_payload": "tensors",
    "return_mm_kwargs": False,
    "ec_transfer_params": None,
    "routed_experts_prompt_start": 0,
    "return_token_offsets": False,
    "return_prompt_text": False,
    "repetition_detection": None,
    # OpenAI's that ask for what a self-hosted model does not do
    "store": False,
    "verbosity": "medium",
}
#: `service_tier` values that ask nothing of a self-hosted model.
SERVICE_TIERS = frozenset({"auto", "default"})
#: Those and null, compared with == (a list there is refused, not unhashable).
_FREE_SERVICE_TIERS = (None, *SERVICE_TIERS)


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """A valid request: what to generate, and how to answer (`echo`: the answer
    starts with a completion's prompt, or a chat's last message where it is the
    assistant's: `generation.echoed`)."""

    model: str | None
    generate: GenerateRequest
    stream: bool
    include_usage: bool
    echo: bool = False
    #: The name the client gave the answer's length (`max_completion_tokens` or
    #: `max_tokens`), for the refusals of the checks after parsing to name it.
    max_tokens_param: str = "max_tokens"
    #: vLLM's `stream_options.continuous_usage_stats` (with `include_usage`): the
    #: usage so far in every chunk.
    continuous_usage: bool = False
    #: vLLM's `stream_interval`: after the first, a stream's chunks hold at least this
    #: many tokens of a choice (1 with `stream` off, where it asks nothing).
    stream_interval: int = 1
    #: Whether a reasoning model's reasoning is shown (Anthropic's `thinking` disabled,
    #: or its display omitted: it is left out, its tokens counted).
    show_reasoning: bool = True
    #: OpenAI's `stream_options.include_obfuscation`: every chunk of the stream padded
    #: (`ObfuscatedRequest`'s; a class's, so a request that does not ask sets no field).
    obfuscate: ClassVar[bool] = False
    #: Whether the answer takes several turns of the model (the Responses API's remote
    #: MCP tools: its route's `turns`); a class's, read by every request.
    turns: ClassVar[bool] = False


@dataclass(frozen=True, slots=True)
class ObfuscatedRequest(ParsedRequest):
    """A request whose stream's chunks are all padded (`include_obfuscation`)."""

    obfuscate: ClassVar[bool] = True


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(
    body: Mapping[str, Any], name: str, low: float, high: float, *, low_open: bool = False
) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_number(value):
        raise invalid(name, f"Invalid type for '{name}': expected a number.")
    if value < low or value > high or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise invalid(name, f"Invalid value for '{name}': must be in {bracket}{low:g}, {high:g}].")
    return float(value)


def _int(
    body: Mapping[str, Any], name: str, low: int = -(2**63), high: int = 2**63 - 1
) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if _is_int(value) and low <= value <= high:
        return int(value)
    # JSON's integers past 64 bits are read as floats: out of range, not of the wrong type
    huge = isinstance(value, float) and value.is_integer() and not low <= value <= high
    if not _is_int(value) and not huge:
        raise invalid(name, f"Invalid type for '{name}': expected an integer.")
    raise invalid(name, f"Invalid value for '{name}': must be in [{low}, {high}].")


def _flag(body: Mapping[str, Any], name: str, where: str = "") -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise invalid(where + name, f"Invalid type for '{where}{name}': expected a boolean.")
    return value


def _string(body: Mapping[str, Any], name: str, where: str = "") -> str | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise invalid(where + name, f"Invalid type for '{where}{name}': expected a string.")
    return value


def _unserved(body: Mapping[str, Any], names: Mapping[str, Any]) -> None:
    """Refuses, by name, a parameter we do not serve that asks for something (the
    first in `names`' order); a body that names none of them costs one set operation."""
    if names.keys().isdisjoint(body):
        return
    present = names.keys() & body.keys()
    for name, default in names.items():
        value = body.get(name) if name in present else None
        if value is not None and value != default:
            raise invalid(name, f"'{name}' is not supported by this gateway.")


def _max_tokens(body: Mapping[str, Any]) -> tuple[int | None, str]:
    """The answer's length and the name it was given: `max_completion_tokens` wins
    (vLLM's order; OpenAI deprecates `max_tokens` for it), and both are checked."""
    deprecated = _int(body, "max_tokens", 1, UINT32_MAX)
    if "max_completion_tokens" not in body:
        return deprecated, "max_tokens"
    value = _int(body, "max_completion_tokens", 1, UINT32_MAX)
    if value is not None:
        return value, "max_completion_tokens"
    return deprecated, "max_tokens"


def _top_k(body: Mapping[str, Any]) -> int | None:
    value = _int(body, "top_k", high=UINT32_MAX)
    if value is None or value in (0, -1):
        return None
    if value < -1:
        raise invalid("top_k", "Invalid value for 'top_k': must be -1, 0 (off) or positive.")
    return value


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise invalid("stop", "Invalid type for 'stop': expected a string or a list of strings.")
    if len(value) > MAX_STOP:
        raise invalid("stop", f"Invalid value for 'stop': at most {MAX_STOP} stop strings.")
    if any(len(s) > MAX_STOP_CHARS for s in value):
        raise invalid(
            "stop", f"Invalid value for 'stop': at most {MAX_STOP_CHARS} characters each."
        )
    return tuple(s for s in value if s)


def _token_ids(body: Mapping[str, Any], name: str, limit: int) -> tuple[int, ...]:
    value = body.get(name)
    if value is None:
        return ()
    if not isinstance(value, list) or not all(_is_int(v) and 0 <= v <= UINT32_MAX for v in value):
        raise invalid(name, f"Invalid type for '{name}': expected a list of token ids.")
    if len(value) > limit:
        raise invalid(name, f"Invalid value for '{name}': at most {limit} token ids.")
    return tuple(value)


def _logit_bias(body: Mapping[str, Any]) -> tuple[tuple[int, float], ...]:
    value = body.get("logit_bias")
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise invalid("logit_bias", "Invalid type for 'logit_bias': expected an object.")
    if len(value) > MAX_LOGIT_BIAS:
        raise invalid("logit_bias", f"Invalid value for 'logit_bias': at most {MAX_LOGIT_BIAS}.")
    pairs = []
    for key, bias in value.items():
        # token ids in ASCII digits only: str.isdigit also takes superscripts (which
        # int() refuses) and other scripts' digits (which int() reads as numbers)
        if not (key.isascii() and key.isdigit() and len(key) <= 10 and int(key) <= UINT32_MAX):
            raise invalid("logit_bias", f"Invalid key in 'logit_bias': {key[:32]!r}: no token id.")
        if not _is_number(bias) or not -100 <= bias <= 100:
            raise invalid("logit_bias", "Invalid value in 'logit_bias': must be in [-100, 100].")
        pairs.append((int(key), float(bias)))
    return tuple(sorted(pairs))


def _repetition_penalty(body: Mapping[str, Any]) -> float | None:
    value = _number(body, "repetition_penalty", 0, 2, low_open=True)
    return None if value == 1 else value  # 1 penalizes nothing: the engine's default


#: The sampling fields after `min_tokens` (checked first, against the answer's length),
#: each with its check, in the order they are checked; each check's value is the
#: `SamplingParams` field of the same name.
_SAMPLING: dict[str, Callable[[Mapping[str, Any]], Any]] = {
    "repetition_penalty": _repetition_penalty,
    "temperature": partial(_number, name="temperature", low=0, high=2),
    "top_p": partial(_number, name="top_p", low=0, high=1, low_open=True),
    "top_k": _top_k,
    "presence_penalty": partial(_number, name="presence_penalty", low=-2, high=2),
    "frequency_penalty": partial(_number, name="frequency_penalty", low=-2, high=2),
    "seed": partial(_int, name="seed"),
    "ignore_eos": lambda body: _flag(body, "ignore_eos") or None,
    "min_p": lambda body: _number(body, "min_p", 0, 1) or None,
    "logit_bias": _logit_bias,
    "stop_token_ids": partial(_token_ids, name="stop_token_ids", limit=MAX_STOP_TOKEN_IDS),
}
_SAMPLING_ORDER = {name: i for i, name in enumerate(_SAMPLING)}


def _sampling(body: Mapping[str, Any], max_tokens: int | None, name: str) -> SamplingParams:
    min_tokens = _int(body, "min_tokens", 0, UINT32_MAX) or None if "min_tokens" in body else None
    if min_tokens is not None and max_tokens is not None and min_tokens > max_tokens:
        raise invalid("min_tokens", f"Invalid value for 'min_tokens': more than '{name}'.")
    # the fields the body has, put in their order in C (the sort's key is dict lookups)
    given = sorted(_SAMPLING.keys() & body.keys(), key=_SAMPLING_ORDER.__getitem__)
    return SamplingParams(
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        **{field: _SAMPLING[field](body) for field in given},
    )


#: `stream_options` keys served: OpenAI's usage chunk and padding of every chunk (against
#: length side channels), and vLLM's usage in every chunk.
STREAM_OPTIONS = frozenset({"include_usage", "include_obfuscation", "continuous_usage_stats"})


def _stream_options(body: Mapping[str, Any], stream: bool) -> tuple[bool, bool, bool]:
    """Whether to add a usage chunk, whether to put the usage so far in every chunk too,
    and whether to pad every chunk (`include_obfuscation`); options without `stream` ask
    nothing (OpenAI's servers accept and drop them), and `continuous_usage_stats` asks
    it only with `include_usage`, as vLLM's server reads them. Padding is off unless
    asked for, as vLLM's server has it (it sends none; OpenAI's default is on): it costs
    bandwidth. A key OpenAI and vLLM do not define is refused by name, as OpenAI
    refuses it."""
    options = body.get("stream_options")
    if options is None:
        return False, False, False
    if not isinstance(options, dict):
        raise invalid("stream_options", "Invalid type for 'stream_options': expected an object.")
    if not STREAM_OPTIONS.issuperset(options):  # one call, where a loop runs per key
        key = next(key for key in options if key not in STREAM_OPTIONS)
        raise invalid(
            f"stream_options.{key[:64]}", f"Unrecognized key in 'stream_options': {key[:64]!r}."
        )
    include_usage = _flag(options, "include_usage", "stream_options.") and stream
    continuous = "continuous_usage_stats" in options and _flag(
        options, "continuous_usage_stats", "stream_options."
    )
    obfuscate = "include_obfuscation" in options and _flag(
        options, "include_obfuscation", "stream_options."
    )
    return include_usage, include_usage and continuous, obfuscate and stream


def model_of(body: Any) -> str | None:
    """The model a body names (None: it names none), checked first so that a
    request to an unknown model is a 404 whatever else is wrong with it."""
    if not isinstance(body, dict):
        raise invalid(None, "The request body must be a JSON object.")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid("model", "Invalid type for 'model': expected a string.")
    return model


def _user(body: Mapping[str, Any]) -> str:
    """The end user's id, as the workers and the logs get it: `user`, else
    `safety_identifier` (OpenAI's newer name for the same stable id)."""
    ids = []
    for name in ("user", "safety_identifier"):
        value = _string(body, name) or ""
        if len(value) > MAX_USER_CHARS:
            raise invalid(name, f"Invalid value for '{name}': at most {MAX_USER_CHARS} characters.")
        ids.append(value)
    return ids[0] or ids[1]


#: The longest `prompt_cache_key`.
MAX_CACHE_KEY_CHARS = 256


def _cache_key(body: Mapping[str, Any]) -> str:
    """`prompt_cache_key`, OpenAI's key for requests that share a prompt's prefix (its
    replacement for `user` there): the request's session key, which routes the requests
    that share it to the worker that served them last, where their prefix is cached."""
    key = _string(body, "prompt_cache_key") or ""
    if len(key) > MAX_CACHE_KEY_CHARS:
        raise invalid(
            "prompt_cache_key",
            f"Invalid value for 'prompt_cache_key': at most {MAX_CACHE_KEY_CHARS} characters.",
        )
    return key


#: vLLM's: the stop string that ends a choice kept at the end of its text.
_INCLUDE_STOP = "include_stop_str_in_output"
#: vLLM's: whether an answer's special tokens are left out of its text (true by default).
_SKIP_SPECIAL = "skip_special_tokens"


#: vLLM's: the prompt cut to its last N tokens (-1: what the context leaves).
_TRUNCATE = "truncate_prompt_tokens"
#: vLLM's: the fewest tokens of a choice in each chunk of a stream after its first.
_INTERVAL = "stream_interval"
#: vLLM's: the answer carries the prompt's and each choice's token ids.
_RETURN_IDS = "return_token_ids"


def _truncation(body: Mapping[str, Any]) -> int | None:
    """`truncate_prompt_tokens`: N of at least 1 (the worker protocol's 32 bits), or -1."""
    value = body.get(_TRUNCATE)
    if value is None:
        return None
    if not _is_int(value) or not (value == -1 or 1 <= value <= INT32_MAX):
        raise invalid(
            _TRUNCATE,
            f"Invalid value for '{_TRUNCATE}': an integer of at least 1, or -1 (as many as "
            "the context leaves beside max_tokens).",
        )
    return value


def text_options(body: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's options of an answer's text, as GenerateRequest fields: the stop string
    kept (`include_stop_str_in_output`), special tokens shown (`skip_special_tokens`
    false; null is its default, true). Most bodies name neither: two lookups."""
    if _INCLUDE_STOP not in body and _SKIP_SPECIAL not in body:
        return _NO_TEXT_OPTIONS
    return {
        "include_stop": _flag(body, _INCLUDE_STOP),
        "skip_special_tokens": body.get(_SKIP_SPECIAL) is None or _flag(body, _SKIP_SPECIAL),
    }


_NO_TEXT_OPTIONS: dict[str, Any] = {}


def _common(
    body: Mapping[str, Any], model: str | None, fields: dict[str, Any], request_id: str
) -> ParsedRequest:
    """What both routes share, for the body naming `model`; `fields` are the route's own
    GenerateRequest fields."""
    _unserved(body, UNSERVED)
    if "service_tier" in body and body["service_tier"] not in _FREE_SERVICE_TIERS:
        raise invalid("service_tier", "'service_tier' is not supported by this gateway.")
    n = _int(body, "n", 1, MAX_N) or 1 if "n" in body else 1
    stream = _flag(body, "stream")
    options = _stream_options(body, stream) if "stream_options" in body else (False, False, False)
    include_usage, continuous_usage, obfuscate = options
    max_tokens, max_tokens_param = _max_tokens(body)
    interval = _int(body, _INTERVAL, 1, INT32_MAX) or 1 if _INTERVAL in body else 1
    request = GenerateRequest(
        model or "",
        sampling=_sampling(body, max_tokens, max_tokens_param),
        stop=_stop(body) if "stop" in body else (),
        n=n,
        user=_user(body) if "user" in body or "safety_identifier" in body else "",
        request_id=request_id,
        session=_cache_key(body) if "prompt_cache_key" in body else "",
        **text_options(body),
        truncate_prompt_tokens=_truncation(body) if _TRUNCATE in body else None,
        return_token_ids=_flag(body, _RETURN_IDS) if _RETURN_IDS in body else False,
        **fields,
    )
    return (ObfuscatedRequest if obfuscate else ParsedRequest)(
        model,
        request,
        stream,
        include_usage,
        max_tokens_param=max_tokens_param,
        continuous_usage=continuous_usage,
        stream_interval=interval if stream else 1,
    )


# -- chat -------------------------------------------------------------------


#: An image part's `detail`, as OpenAI takes it.
_DETAILS = frozenset({"auto", "low", "high"})


def _image(part: Mapping[str, Any], where: str) -> ContentPart:
    image = part.get("image_url")
    url = image.get("url") if isinstance(image, dict) else image
    if not isinstance(url, str) or not _IMAGE_URL.match(url):
        raise invalid(
            f"{where}.image_url",
            "Invalid 'image_url': expected {\"url\": an http(s) URL or a data:image/ URI}.",
        )
    detail = image.get("detail") if isinstance(image, dict) else None
    if detail is not None and (not isinstance(detail, str) or detail not in _DETAILS):
        raise invalid(
            f"{where}.image_url.detail", "Invalid 'detail': expected 'auto', 'low' or 'high'."
        )
    return ContentPart("image_url", url=url, detail=detail or "")


def _media(part: Mapping[str, Any], kind: str, where: str) -> ContentPart:
    """An `input_audio` part (OpenAI's: base64 `data` and its `format`), or an `audio_url`
    or `video_url` part (vLLM's: an http(s) URL or a `data:audio/` or `data:video/` URI),
    checked as OpenAI checks its parts."""
    value = part.get(kind)
    if kind != "input_audio":
        url = value.get("url") if isinstance(value, dict) else value
        if not isinstance(url, str) or not _MEDIA_URLS[kind].match(url):
            media = kind.split("_")[0]
            raise invalid(
                f"{where}.{kind}",
                f"Invalid '{kind}': expected {{\"url\": an http(s) URL or a data:{media}/ URI}}.",
            )
        return ContentPart(kind, url=url)
    if not isinstance(value, dict):
        raise invalid(f"{where}.input_audio", "Invalid 'input_audio': expected an object.")
    data, format_ = value.get("data"), value.get("format")
    if not isinstance(data, str) or not data or not _is_base64(data):
        raise invalid(
            f"{where}.input_audio.data", "Invalid 'input_audio.data': expected base64 audio."
        )
    if not isinstance(format_, str) or not _AUDIO_FORMAT.fullmatch(format_):
        raise invalid(
            f"{where}.input_audio.format",
            "Invalid 'input_audio.format': expected the audio's format, such as 'wav' or 'mp3'.",
        )
    return ContentPart(kind, data=data, format=format_)


def _is_base64(data: str) -> bool:
    """Whether `data` is base64 (padded, no other characters), decoded in C to know."""
    try:
        binascii.a2b_base64(data, strict_mode=True)
    except (binascii.Error, ValueError):  # ValueError: not ASCII
        return False
    return True


def _content(content: Any, where: str) -> tuple[str, tuple[str, ...], tuple[ContentPart, ...]]:
    """A message's content that is not a string (`_messages` takes those as they are):
    its text, its parts joined, its images in order, and the parts themselves in order
    when they hold an image, a sound or a video (an OpenAI upstream gets them as they
    came)."""
    if content is None:
        return "", (), ()
    if not isinstance(content, list):
        raise invalid(where, f"Invalid type for '{where}': expected a string or a list of parts.")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise invalid(f"{where}[{j}].text", "Invalid type: expected a string.")
            parts.append(ContentPart("text", text))
        elif kind == "image_url":
            parts.append(_image(part, f"{where}[{j}]"))
        elif isinstance(kind, str) and kind in RELAYED_PARTS:  # a list or object: unhashable
            parts.append(_media(part, kind, f"{where}[{j}]"))
        else:
            raise invalid(
                f"{where}[{j}]",
                "Only content parts of type 'text', 'image_url', 'input_audio', 'audio_url' "
                "and 'video_url' are supported.",
            )
    images = tuple(p.url for p in parts if p.type == "image_url")
    text = "".join(p.text for p in parts if p.type == "text")
    held = images or any(p.type in RELAYED_PARTS for p in parts)
    return text, images, tuple(parts) if held else ()


def _tool_calls(message: Mapping[str, Any], where: str) -> tuple[ToolCall, ...]:
    calls = message.get("tool_calls")
    if calls is None:
        return ()
    if not isinstance(calls, list) or len(calls) > MAX_TOOL_CALLS:
        raise invalid(where, f"Invalid '{where}': expected a list of at most {MAX_TOOL_CALLS}.")
    parsed = []
    for k, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise invalid(f"{where}[{k}].function", "Invalid type: expected an object.")
        parsed.append(
            ToolCall(
                _required_string(call, "id", f"{where}[{k}]."),
                _required_string(function, "name", f"{where}[{k}].function."),
                _string(function, "arguments", f"{where}[{k}].function.") or "{}",
            )
        )
    return tuple(parsed)


def _required_string(body: Mapping[str, Any], name: str, where: str) -> str:
    value = _string(body, name, where)
    if not value:
        raise invalid(where + name, f"'{where}{name}' is required.")
    return value


def _messages(body: Mapping[str, Any]) -> tuple[Message, ...]:
    return chat_messages(body.get("messages"))


def chat_messages(messages: Any) -> tuple[Message, ...]:
    """A chat's `messages`, checked as a chat completion's (a 400 names `messages[i]...`)."""
    if not isinstance(messages, list):
        raise invalid("messages", "'messages' is required and must be a list.")
    if not messages:
        raise invalid("messages", "'messages' must hold at least one message.")
    parsed = []
    images = media = 0
    tool_use = False  # whether a message calls a tool or answers a call
    # the parameter a refusal names is spelled only when there is one
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise invalid(f"messages[{i}]", "Invalid type: expected an object.")
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise invalid(
                f"messages[{i}].role", f"Invalid value: must be one of {', '.join(sorted(ROLES))}."
            )
        content = message.get("content")
        pictures: tuple[str, ...]
        parts: tuple[ContentPart, ...]
        if isinstance(content, str):
            text, pictures, parts = content, (), ()
        else:
            text, pictures, parts = _content(content, f"messages[{i}].content")
            images += len(pictures)
            if images > MAX_IMAGES:
                raise invalid(
                    f"messages[{i}].content", f"At most {MAX_IMAGES} images in a request."
                )
            if parts:
                media += sum(p.type in RELAYED_PARTS for p in parts)
                if media > MAX_MEDIA:
                    raise invalid(
                        f"messages[{i}].content",
                        f"At most {MAX_MEDIA} sounds and videos in a request.",
                    )
        calls: tuple[ToolCall, ...] = ()
        if role == "assistant" and "tool_calls" in message:
            calls = _tool_calls(message, f"messages[{i}].tool_calls")
            tool_use = tool_use or bool(calls)
        call_id = name = ""
        if "tool_call_id" in message:
            call_id = _string(message, "tool_call_id", f"messages[{i}].") or ""
        if role == "tool":
            tool_use = True
            if not call_id:
                raise invalid(f"messages[{i}].tool_call_id", "A tool message needs 'tool_call_id'.")
        if "name" in message:
            name = _string(message, "name", f"messages[{i}].") or ""
        reasoning = ""
        if role == "assistant" and not _REASONING_KEYS.isdisjoint(message):
            reasoning = _message_reasoning(message, f"messages[{i}].")
        parsed.append(Message(role, text, pictures, calls, call_id, name, parts, reasoning))
    if tool_use:
        _check_tool_answers(parsed)
    return tuple(parsed)


#: An assistant message's reasoning: vLLM's name, and the name it had before.
_REASONING_KEYS = frozenset({"reasoning", "reasoning_content"})


def _message_reasoning(message: Mapping[str, Any], where: str) -> str:
    """An assistant message's reasoning, under vLLM's name or its former one."""
    for name in ("reasoning", "reasoning_content"):
        value = _string(message, name, where)
        if value:
            return value
    return ""


def _check_tool_answers(messages: list[Message]) -> None:
    """As OpenAI checks them: an assistant message's tool calls are answered, each by a
    `tool` message naming its id, right after it; and a `tool` message answers one of
    those calls (a chat template would otherwise render a conversation no model saw)."""
    waiting: dict[str, None] = {}  # the ids of the calls not yet answered, in order
    asked_at = 0  # the assistant message that made them
    for i, message in enumerate(messages):
        if message.role == "tool":
            if message.tool_call_id not in waiting:
                raise invalid(
                    f"messages[{i}].tool_call_id",
                    "A 'tool' message must answer a tool call of the assistant message "
                    f"before it: no call '{message.tool_call_id[:64]}' is waiting for one.",
                )
            del waiting[message.tool_call_id]
        elif waiting:
            break
        elif message.tool_calls:
            waiting, asked_at = dict.fromkeys(call.id for call in message.tool_calls), i
    if waiting:
        unanswered = ", ".join(call_id[:64] for call_id in waiting)
        raise invalid(
            f"messages[{asked_at}].tool_calls",
            "An assistant message with 'tool_calls' must be followed by tool messages "
            f"answering each 'tool_call_id'; these have none: {unanswered}.",
        )


def _tools(body: Mapping[str, Any], budget: SchemaBudget) -> tuple[Tool, ...]:
    tools = body.get("tools")
    if tools is None:
        return ()
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise invalid("tools", f"Invalid 'tools': expected a list of at most {MAX_TOOLS}.")
    parsed = []
    for k, tool in enumerate(tools):
        where = f"tools[{k}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise invalid(f"{where}.type", "Only tools of type 'function' are supported.")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise invalid(f"{where}.function", "Invalid type: expected an object.")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise invalid(f"{where}.function.name", "Invalid name: 1-64 of a-z, A-Z, 0-9, _ and -.")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise invalid(f"{where}.function.parameters", "Invalid type: expected an object.")
        if parameters is not None:
            budget.check(parameters, f"{where}.function.parameters")
        parsed.append(
            Tool(
                name,
                _string(function, "description", f"{where}.function.") or "",
                orjson.dumps(parameters).decode() if parameters is not None else "",
                _flag(function, "strict", f"{where}.function."),
            )
        )
    if len({tool.name for tool in parsed}) != len(parsed):
        raise invalid("tools", "Invalid 'tools': function names must be unique.")
    return tuple(parsed)


def _tool_choice(body: Mapping[str, Any], tools: tuple[Tool, ...]) -> str:
    choice = body.get("tool_choice")
    if choice is None:
        return ""
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise invalid("tool_choice", "Invalid 'tool_choice': expected a function by name.")
        if name not in {tool.name for tool in tools}:
            raise invalid("tool_choice", f"Invalid 'tool_choice': no tool is named {name[:64]!r}.")
        return name
    if choice not in ("none", "auto", "required"):
        raise invalid("tool_choice", "Invalid 'tool_choice': none, auto, required or a function.")
    if choice == "none":
        return "none" if tools else ""
    if not tools:
        raise invalid("tool_choice", "'tool_choice' is only allowed when 'tools' are given.")
    return str(choice)


def _response_format(body: Mapping[str, Any], budget: SchemaBudget) -> ResponseFormat | None:
    value = body.get("response_format")
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat("json_object")
    if kind != "json_schema":
        raise invalid(
            "response_format", "Invalid 'response_format': type text, json_object or json_schema."
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise invalid("response_format.json_schema", "Invalid type: expected an object.")
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise invalid(
            "response_format.json_schema.name", "Invalid name: 1-64 of a-z, A-Z, 0-9, _ and -."
        )
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise invalid("response_format.json_schema.schema", "Invalid type: expected an object.")
    budget.check(schema, "response_format.json_schema.schema")
    strict = _flag(spec, "strict", "response_format.json_schema.")
    return ResponseFormat("json_schema", orjson.dumps(schema).decode(), name, strict)


#: The most characters a `structured_outputs` regex or grammar, or its choices together,
#: may take (the engine compiles each into an automaton over its vocabulary).
MAX_CONSTRAINT_CHARS = 64 * 1024
#: The most `structured_outputs.choice` may list.
MAX_CHOICES = 1024
#: `structured_outputs`' constraints (one of them), and its options that ask nothing at
#: these values (vLLM's defaults); any other value of an option is refused by name.
_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")
_CONSTRAINT_OPTIONS: dict[str, Any] = {
    "disable_any_whitespace": False,
    "disable_additional_properties": False,
    "whitespace_pattern": None,
    "structural_tag": None,
}


def _constraint_text(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise invalid(param, f"Invalid type for '{param}': expected a non-empty string.")
    if len(value) > MAX_CONSTRAINT_CHARS:
        raise invalid(param, f"Invalid '{param}': at most {MAX_CONSTRAINT_CHARS} characters.")
    return value


def _structured_outputs(body: Mapping[str, Any], budget: SchemaBudget) -> ResponseFormat | None:
    """vLLM's `structured_outputs`: the one constraint it gives (`json`, a JSON schema;
    `regex`; `choice`; `grammar`, in vLLM's EBNF; `json_object`), as our ResponseFormat;
    None when it gives none."""
    value = body.get("structured_outputs")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid(
            "structured_outputs", "Invalid type for 'structured_outputs': expected an object."
        )
    for key in value:
        if key not in _CONSTRAINTS and key not in _CONSTRAINT_OPTIONS:
            raise invalid(
                f"structured_outputs.{key}", f"Unknown parameter: 'structured_outputs.{key}'."
            )
    for key, default in _CONSTRAINT_OPTIONS.items():
        if value.get(key, default) not in (default, None):
            raise invalid(
                f"structured_outputs.{key}",
                f"'structured_outputs.{key}' is not supported by this gateway.",
            )
    given = [key for key in _CONSTRAINTS if value.get(key) is not None]
    if len(given) > 1:
        raise invalid(
            f"structured_outputs.{given[1]}",
            "You can only use one kind of constraints for structured outputs "
            f"({', '.join(given)} were given).",
        )
    if not given:
        return None
    kind = given[0]
    param = f"structured_outputs.{kind}"
    spec = value[kind]
    if kind == "json_object":
        if not isinstance(spec, bool):
            raise invalid(param, f"Invalid type for '{param}': expected a boolean.")
        return ResponseFormat("json_object") if spec else None
    if kind == "json":
        if isinstance(spec, str):
            try:
                spec = orjson.loads(spec)
            except orjson.JSONDecodeError:
                raise invalid(param, f"Invalid '{param}': not JSON.") from None
        if not isinstance(spec, dict):
            raise invalid(param, f"Invalid type for '{param}': expected a JSON schema object.")
        budget.check(spec, param)
        # no name: it came as vLLM's, and goes on as vLLM's
        return ResponseFormat("json_schema", orjson.dumps(spec).decode(), strict=True)
    if kind == "choice":
        if (
            not isinstance(spec, list)
            or not spec
            or len(spec) > MAX_CHOICES
            or not all(isinstance(choice, str) and choice for choice in spec)
        ):
            raise invalid(
                param,
                f"Invalid '{param}': a list of 1 to {MAX_CHOICES} non-empty strings.",
            )
        if sum(map(len, spec)) > MAX_CONSTRAINT_CHARS:
            raise invalid(param, f"Invalid '{param}': at most {MAX_CONSTRAINT_CHARS} characters.")
        return ResponseFormat("choice", choice=tuple(spec))
    if kind == "regex":
        return ResponseFormat("regex", regex=_constraint_text(spec, param))
    return ResponseFormat("grammar", grammar=_constraint_text(spec, param))


def with_structured_outputs(
    body: Mapping[str, Any],
    given: ResponseFormat | None,
    budget: SchemaBudget,
    tool_choice: str,
    given_param: str = "response_format",
) -> ResponseFormat | None:
    """The format the answer follows: `given` (the API's own: chat's `response_format`,
    the Responses API's `text.format`, named `given_param`) or vLLM's
    `structured_outputs`, not both (vLLM refuses both), nor a constraint with a forced
    `tool_choice` (as vLLM)."""
    structured = _structured_outputs(body, budget)
    if structured is None:
        return given
    if given is not None:
        raise invalid(
            "structured_outputs", f"Cannot specify both structured_outputs and {given_param}."
        )
    if tool_choice not in ("", "none", "auto"):
        raise invalid(
            "structured_outputs",
            "You can only either use constraints for structured outputs or tools, not both.",
        )
    return structured


def _chat_logprobs(body: Mapping[str, Any]) -> int | None:
    top = _int(body, "top_logprobs", 0, MAX_LOGPROBS)
    if not _flag(body, "logprobs"):
        if top:
            raise invalid("top_logprobs", "'top_logprobs' needs 'logprobs' set to true.")
        return None
    return top or 0


#: vLLM's reasoning parameters (`_reasoning`).
_REASONING_FIELDS = (
    "reasoning_effort",
    "include_reasoning",
    "chat_template_kwargs",
    "thinking_token_budget",
)
#: Completions' parameters, refused on chat where they ask for something.
_CHAT_UNSERVED = {"best_of": None, "suffix": None, "add_special_tokens": False}
#: Chat's parameters besides its messages and those `_common` reads.
_CHAT_FIELDS = frozenset(
    {
        "tools",
        "parallel_tool_calls",
        "logprobs",
        "top_logprobs",
        "tool_choice",
        "response_format",
        "structured_outputs",
        "add_generation_prompt",
        "continue_final_message",
        "echo",
        *_REASONING_FIELDS,
    }
)


def _chat_end(body: Mapping[str, Any]) -> dict[str, bool]:
    """How the chat's prompt ends, as vLLM takes it: after the template's generation
    prompt (`add_generation_prompt`, true unless given), or inside the last message,
    which the answer continues (`continue_final_message`: a prefill); both true is
    refused, as vLLM refuses it (the generation prompt is then left out unless asked)."""
    open_end = _flag(body, "continue_final_message")
    generation = _flag(body, "add_generation_prompt")  # (False when not given)
    if open_end and generation:
        raise invalid(
            "continue_final_message",
            "Cannot set both 'continue_final_message' and 'add_generation_prompt' to true.",
        )
    generation = not open_end and (generation or body.get("add_generation_prompt") is None)
    return {"add_generation_prompt": generation, "continue_final_message": open_end}


def reasoning_effort(body: Mapping[str, Any], name: str, where: str = "") -> str | None:
    """`body[name]`, one of vLLM's reasoning efforts (None: not given); `where` is the
    path before the name, in a refusal."""
    effort = _string(body, name, where)
    if effort is not None and effort not in REASONING_EFFORTS:
        raise invalid(
            where + name,
            f"Invalid value for '{where}{name}': expected one of {', '.join(REASONING_EFFORTS)}.",
        )
    return effort


def template_kwargs(body: Mapping[str, Any]) -> str:
    """The body's `chat_template_kwargs` as a JSON object's text ("": none or empty), or
    a 400 naming it."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return ""
    if not isinstance(kwargs, dict):
        raise invalid(
            "chat_template_kwargs", "Invalid type for 'chat_template_kwargs': expected an object."
        )
    text = orjson.dumps(kwargs)  # a body's JSON, read by orjson: it writes it back
    if len(text) > MAX_TEMPLATE_KWARGS_BYTES:
        raise invalid(
            "chat_template_kwargs",
            f"Invalid value for 'chat_template_kwargs': at most {MAX_TEMPLATE_KWARGS_BYTES} "
            "bytes of JSON.",
        )
    return text.decode() if kwargs else ""


def _reasoning(body: Mapping[str, Any]) -> ReasoningParams | None:
    """vLLM's reasoning parameters (None: none that asks anything)."""
    fields: dict[str, Any] = {}
    effort = reasoning_effort(body, "reasoning_effort")
    if effort is not None:
        fields["effort"] = effort
    if body.get("include_reasoning") is not None:
        fields["include"] = _flag(body, "include_reasoning")
    kwargs = template_kwargs(body)
    if kwargs:
        fields["template_kwargs"] = kwargs
    budget = _int(body, "thinking_token_budget", -1, UINT32_MAX)
    if budget is not None and budget != -1:  # vLLM's -1: no bound
        fields["budget"] = budget
    reasoning = ReasoningParams(**fields)
    return None if reasoning == _NO_REASONING else reasoning


_NO_REASONING = ReasoningParams()


def parse_chat(body: Any, request_id: str = "") -> ParsedRequest:
    """A /v1/chat/completions body, checked (for the request `request_id`)."""
    model = model_of(body)
    _unserved(body, _CHAT_UNSERVED)
    if _CHAT_FIELDS.isdisjoint(body):  # a plain chat: the checks below would find nothing
        return _common(body, model, {"messages": _messages(body)}, request_id)
    schemas = SchemaBudget()  # the tools' and response_format's, together
    tools = _tools(body, schemas)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise invalid("parallel_tool_calls", "Invalid type: expected a boolean.")
    choice = _tool_choice(body, tools)
    fields = {
        "messages": _messages(body),
        "logprobs": _chat_logprobs(body),
        "tools": tools,
        "tool_choice": choice,
        "parallel_tool_calls": parallel if tools else None,
        "response_format": with_structured_outputs(
            body, _response_format(body, schemas), schemas, choice
        ),
        "reasoning": _reasoning(body),
        **_chat_end(body),
    }
    parsed = _common(body, model, fields, request_id)
    # vLLM's: the answer starts with the last message when it is the answer's role
    return replace(parsed, echo=True) if _flag(body, "echo") else parsed


# -- completions --------------------------------------------------------------


#: Chat's parameters and vLLM's, refused on completions where they ask for something.
_COMPLETION_UNSERVED = {
    "reasoning_effort": None,  # a chat template's: a completion has none
    "chat_template_kwargs": None,
    "include_reasoning": True,
    "thinking_token_budget": None,
    "tools": None,
    "tool_choice": None,
    "messages": None,
    "prompt_embeds": None,
    "add_special_tokens": True,
    "add_generation_prompt": True,
    "continue_final_message": False,
}


def parse_completion(body: Any, request_id: str = "") -> ParsedRequest:
    """A /v1/completions body, checked (for the request `request_id`)."""
    model = model_of(body)
    _unserved(body, _COMPLETION_UNSERVED)
    if body.get("suffix"):
        raise invalid("suffix", "'suffix' is not supported.")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise invalid("prompt", "'prompt' is required and must be one string.")
    logprobs = _int(body, "logprobs", 0, MAX_LOGPROBS)
    echo = _flag(body, "echo")
    if echo and logprobs is not None:
        raise invalid("echo", "'echo' with 'logprobs' (the prompt's logprobs) is not supported.")
    budget = SchemaBudget()
    parsed = _common(
        body,
        model,
        {
            "prompt": prompt,
            "logprobs": logprobs,
            "response_format": with_structured_outputs(
                body, _response_format(body, budget), budget, ""
            ),
        },
        request_id,
    )
    best_of = _int(body, "best_of", 1, MAX_N)
    if best_of is not None and best_of != parsed.generate.n:
        raise invalid("best_of", "'best_of' other than 'n' is not supported.")
    return replace(parsed, echo=echo)
