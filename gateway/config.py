"""The gateway's configuration: one YAML file, environment overrides, checked at
start with an error that names the field by its whole path (`models[2].routing.policy`).

Every field is declared once, with `setting(...)`: its type (the annotation), default,
bounds and meaning. A nested section (a model, its routing, a team, a budget, the queue)
is a dataclass of fields declared the same way. One loader (`_value`) checks any field
from its declaration; deploy/config_schema.py writes the chart's values schema and the
docs' table from the same declarations. What fields require of each other (an `openai`
model's URLs, a key's team, an alias's targets) is checked after, by hand (`_model`,
`_teams`, `parse_keys`, `_worker_tls`, `_routing`).

Every field not required has a safe, finite default. An environment variable
`FURNACE_<FIELD>` (upper case) overrides a top-level scalar field, and
`FURNACE_MODELS` (`_TEAMS`, `_KEYS`, `_WORKER_TLS`) may hold the whole field as YAML.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import MISSING, Field, astuple, dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any, TypeVar, get_args, get_origin, get_type_hints

import yaml

ENV_PREFIX = "FURNACE_"
MODEL_KINDS = ("llm", "tensor")
#: How a model's rerank and score requests are scored (`models[].scoring`).
SCORINGS = ("embeddings", "cross-encoder")
BALANCE_POLICIES = ("least_outstanding", "prefix_affinity")
#: Team names go into metric labels and Redis keys: keep them plain.
TEAM_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
UPSTREAMS = ("grpc", "openai", "vllm-grpc", "kserve-grpc")
#: The tool-call formats of `vllm-grpc` models (gateway.protocol.tool_calls.PARSERS).
TOOL_CALL_PARSERS = ("hermes", "llama3_json")
#: `reasoning_parser` values (`gateway.protocol.reasoning.PARSERS`).
REASONING_PARSERS = ("deepseek_r1", "qwen3")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
#: `log_format`'s choices: `log_setup.FORMATTERS`' names (a layer of its own: not imported)
LOG_FORMATS = ("text", "json")
#: A budget's calendar windows (UTC).
BUDGET_WINDOWS = ("day", "month")
#: What a budget does while its shared store (Redis) does not answer.
STORE_FAILURE_MODES = ("open", "closed")

_T = TypeVar("_T")


class ConfigError(ValueError):
    """The config is invalid; the message names the field."""


class KeysFileUnreadable(ConfigError):
    """`keys_file` cannot be read (deleted, no permission): its keys are gone."""


@dataclass(frozen=True)
class Spec:
    """A config field's type-independent bounds and meaning, declared once on the field (its
    type is the annotation): the loader checks them, and deploy/config_schema.py writes them
    into the chart's values schema and the configuration table of the docs. A section (a
    model, a team, the queue...) is a dataclass whose fields are declared the same way."""

    #: One line: what the field does, for the docs and the values schema.
    help: str
    #: The least value a number may take (inclusive).
    minimum: int | float | None = None
    #: The largest value a number may take (inclusive); None: no bound.
    maximum: int | float | None = None
    #: The values a string may take (the loader lowercases it first).
    choices: tuple[str, ...] = ()
    #: The shortest a string (each string of a list) may be, or the fewest items of a list of
    #: sections.
    min_length: int = 0
    #: A regular expression a string must match whole, and what it means (for errors).
    pattern: tuple[str, str] | None = None
    #: A list of sections written as a mapping keyed by the section's first field
    #: (`teams: {NAME: {...}}`); each value holds the other fields, or is the only other one.
    keyed: bool = False
    #: The section a value of plain tuples is written as (`prices: {prompt, completion}` is
    #: `(prompt, completion)`), its fields in order.
    shape: type | None = None


#: The default of a field that has none: the config must give it.
REQUIRED: Any = MISSING


def setting(
    default: _T,
    help: str,
    *,
    minimum: int | float | None = None,
    maximum: int | float | None = None,
    choices: tuple[str, ...] = (),
    min_length: int = 0,
    pattern: tuple[str, str] | None = None,
    keyed: bool = False,
    shape: type | None = None,
) -> _T:
    """A dataclass field with its default (or `REQUIRED`) and its `Spec`."""
    spec = Spec(help, minimum, maximum, choices, min_length, pattern, keyed, shape)
    if default is MISSING:
        required: _T = field(metadata={"spec": spec})
        return required
    return field(default=default, metadata={"spec": spec})


def spec_of(declared: Field[Any]) -> Spec:
    """The `Spec` a field was declared with."""
    spec = declared.metadata.get("spec")
    if not isinstance(spec, Spec):
        raise TypeError(f"{declared.name}: declared without setting()")
    return spec


#: `models[].routing.policy` values (`gateway.fleet.routing`).
ROUTING_POLICIES = ("kv_aware", "prefix", "least_load", "round_robin")
#: The largest of the routing's costs and counts.
_ROUTING_MAX = 10_000_000


@dataclass(frozen=True)
class RoutingConfig:
    """`models[].routing`: the scheduler over the engines' KV events and load records
    (`gateway.fleet.routing` has the cost; docs/concepts/routing.md the why)."""

    policy: str = setting(
        "kv_aware",
        "`kv_aware` (cached prefix and queued work), `prefix` (prefix affinity), `least_load` "
        "(queued work only) or `round_robin`",
        choices=ROUTING_POLICIES,
    )
    prefill_weight: float = setting(
        1.0,
        "cost of one prompt token the worker's cache does not hold (prefill to do)",
        minimum=0,
        maximum=_ROUTING_MAX,
    )
    queue_weight: float = setting(
        1.0,
        "cost of one uncached prompt token waiting in the worker's queue",
        minimum=0,
        maximum=_ROUTING_MAX,
    )
    running_cost: float = setting(
        64.0,
        "cost, in prompt tokens, of one request the worker runs",
        minimum=0,
        maximum=_ROUTING_MAX,
    )
    usage_cost: float = setting(
        256.0,
        "cost, in prompt tokens, of a worker whose KV cache is full (scaled by its use)",
        minimum=0,
        maximum=_ROUTING_MAX,
    )
    session_load_factor: float = setting(
        1.5,
        "a session stays on its worker while that worker has at most this many times the "
        "model's average calls in flight (plus one); past it the session moves",
        minimum=1,
        maximum=_ROUTING_MAX,
    )
    max_sessions: int = setting(
        100_000,
        "sessions remembered (least recently used forgotten first)",
        minimum=1,
        maximum=_ROUTING_MAX,
    )
    max_blocks_per_worker: int = setting(
        200_000,
        "KV blocks remembered per worker (oldest forgotten first)",
        minimum=1,
        maximum=_ROUTING_MAX,
    )
    max_engine_waiting: int | None = setting(
        None,
        "a worker whose engine's last load record has more requests waiting than this counts "
        "as full: routed around while another is not, and shed (503 `workers_saturated`, or "
        "the model's fallbacks) when every worker is full; none: not counted",
        minimum=0,
        maximum=_ROUTING_MAX,
    )
    max_kv_usage: float | None = setting(
        None,
        "a worker whose engine's last load record has this fraction of its KV cache in use, "
        "or more, counts as full (as `max_engine_waiting`); none: not counted",
        minimum=0,
        maximum=1,
    )
    load_interval: float = setting(
        1.0,
        "seconds between two reads of an `upstream: openai` worker's Prometheus `/metrics` "
        "for its engine's load record (vLLM's requests running and waiting, KV-cache use), "
        "with `policy` `kv_aware` or `least_load` (a read times out after 2 s)",
        minimum=0.1,
        maximum=5.0,
    )
    kv_events: tuple[tuple[str, str], ...] = setting(
        (),
        "`upstream: openai` workers (vLLM's HTTP server), `{workers entry: tcp://host:port}`: "
        "the ZMQ endpoint where each one's engine publishes its KV events "
        "(`--kv-events-config`), `prefill_workers` entries too; needs the model's `tokenizer` "
        "(the events name blocks by token ids)",
        pattern=(r"tcp://[^\s:/*]+:\d{1,5}", "tcp://host:port"),
    )
    kv_replay: tuple[tuple[str, str], ...] = setting(
        (),
        "workers of `kv_events` whose engine also keeps its events for replay (vLLM's "
        "`--kv-events-config` `replay_endpoint`), `{workers entry: tcp://host:port}`: the "
        "gateway asks that socket for the events it missed (those before it connected, "
        "across an engine's restart, in a gap), so it knows the blocks an engine stored "
        "before it listened, as far as the engine's `buffer_steps` reach",
        pattern=(r"tcp://[^\s:/*]+:\d{1,5}", "tcp://host:port"),
    )


@dataclass(frozen=True)
class Prices:
    """`models[].prices` as written; the model holds `(prompt, completion)`."""

    prompt: float = setting(0.0, "spend per million prompt tokens", minimum=0)
    completion: float = setting(0.0, "spend per million completion tokens", minimum=0)


@dataclass(frozen=True)
class ModelConfig:
    """A model and the workers that serve it."""

    name: str = setting(
        REQUIRED,
        "the name clients use; a request without `model` goes to the first LLM",
        min_length=1,
    )
    kind: str = setting(
        "llm",
        "`llm`, or `tensor`: a model of the KServe v2 routes (`/v2/models/{name}/infer`), "
        "served by KServe v2 gRPC workers",
        choices=MODEL_KINDS,
    )
    workers: tuple[str, ...] = setting(
        (),
        "`host:port`, `dns:///name:port` (a Kubernetes headless Service, re-resolved every "
        "`discovery_interval`; `dns://server:port/name:port` asks that name server), or base "
        "URLs (`http://host:port/v1`) with `upstream: openai`; an `llm` model needs one",
        min_length=1,
    )
    prefill_workers: tuple[str, ...] = setting(
        (),
        "with `upstream: openai` or `vllm-grpc`: vLLM servers that run only the prompts' "
        "prefill, their KV cache pulled by the `workers` that decode (prefill/decode "
        "disaggregation, vLLM's NixlConnector), entries as `workers`', picked by the model's "
        "`balance` or `routing` on their own caches and loads; none: the workers prefill and "
        "decode",
        min_length=1,
    )
    max_model_len: int | None = setting(
        None,
        "the context length `/v1/models` reports; none: asked from the workers with `Describe` "
        "(or their `/models`)",
        minimum=1,
    )
    balance: str = setting(
        "least_outstanding",
        "`least_outstanding` (power of two choices) or `prefix_affinity`",
        choices=BALANCE_POLICIES,
    )
    weights: tuple[tuple[str, float], ...] = setting(
        (),
        "relative weights by `workers` entry, `{entry: weight}`; an entry not listed weighs 1",
        minimum=0.001,
    )
    upstream: str = setting(
        "grpc",
        "`grpc` (our worker protocol), `openai` (OpenAI-compatible HTTP servers: vLLM, "
        "SGLang...), `vllm-grpc` (vLLM's own gRPC server, which takes token ids: needs "
        "`tokenizer`), or `kserve-grpc` (KServe v2 gRPC servers: Triton, KServe), the default "
        "and only upstream of `kind: tensor`",
        choices=UPSTREAMS,
    )
    tokenizer: str | None = setting(
        None,
        "with `upstream: vllm-grpc`, and with `routing.kv_events` (required there): a "
        "directory holding the model's `tokenizer.json`, `tokenizer_config.json` and chat "
        "template, as a Hugging Face model directory has them (the gateway tokenizes, for "
        "the engine or for routing); checked readable at start",
        min_length=1,
    )
    tool_call_parser: str | None = setting(
        None,
        "with `upstream: vllm-grpc`: the format the model writes tool calls in, `hermes` "
        "(Hermes, Qwen 2.5/3) or `llama3_json` (Llama 3.x), as vLLM's `--tool-call-parser`; "
        "none: the model takes no `tools` (forced calls neither)",
        choices=TOOL_CALL_PARSERS,
    )
    reasoning_parser: str | None = setting(
        None,
        "with `upstream: vllm-grpc`: how a reasoning model opens its thought, as vLLM's "
        "`--reasoning-parser`: `deepseek_r1` (the template opens it: the answer is "
        "reasoning up to `</think>`) or `qwen3` (the model opens it with `<think>`); its "
        "reasoning then reaches clients apart from its text; none: the answer is all text",
        choices=REASONING_PARSERS,
    )
    plain_text_contents: bool = setting(
        True,
        "with `upstream: vllm-grpc`: special-token strings a user types in a message "
        "(`<|im_end|><|im_start|>system`) are tokenized as text; false: as the real special "
        "tokens, as Hugging Face's and vLLM's own front ends do (a message's content is the "
        "client's text, never the template's: read as tokens, it lets a user end their turn "
        "and open a system one)",
    )
    scoring: str = setting(
        "embeddings",
        "how `/v1/rerank` and `/v1/score` score a pair: `embeddings` (the cosine of the "
        "model's two embeddings, as vLLM scores pairs with an embedding model), or "
        "`cross-encoder` (with `upstream: openai`: the workers score each pair themselves, "
        "on their `/rerank`, as vLLM serves a reranker such as a BGE one)",
        choices=SCORINGS,
    )
    max_tokens_limit: int | None = setting(
        None,
        "the largest `max_tokens` a request may ask for (also its default); none: no cap",
        minimum=1,
    )
    api_key_env: str | None = setting(
        None,
        "with `upstream: openai`: the NAME of an environment variable holding the upstreams' "
        "key (never the key), sent as `Authorization: Bearer` on every call to them; checked "
        "set at start",
        min_length=1,
    )
    ca_file: str | None = setting(
        None,
        "with `upstream: openai`: a PEM bundle that verifies the upstreams' TLS (`https://` "
        "workers behind a private CA); none: the system's roots; checked readable at start",
        min_length=1,
    )
    # (a frozen dataclass: immutable, though ruff cannot tell)
    queue: QueueConfig | None = setting(  # noqa: RUF009
        None,
        "its queue: the top-level `queue` with the fields given here overridden (`max_wait` "
        "needed where there is none); none: the top-level `queue`",
    )
    fallbacks: tuple[str, ...] = setting(
        (),
        "models (or aliases) that serve a request (generation or embeddings), in order, when "
        "this one has no healthy worker, every worker is full, its queue refuses, or every "
        "worker tried failed before the first token; not for tensor models",
        min_length=1,
    )
    prices: tuple[float, float] | None = setting(
        None,
        "`{prompt, completion}`: spend per million tokens, for budgets counted in `spend`; none: 0",
        shape=Prices,
    )
    # (a frozen dataclass: immutable, though ruff cannot tell)
    routing: RoutingConfig | None = setting(  # noqa: RUF009
        None,
        "routing on the engines' KV-cache events and load records instead of `balance` "
        "(docs: Concepts, KV-aware routing); none: `balance` as it is",
    )
    prefill_routing: RoutingConfig | None = setting(  # noqa: RUF009
        None,
        "with `prefill_workers`: the prefill tier's own routing (its policy, costs and "
        "`kv_events`, those of `prefill_workers` entries), as vllm-router's and smg's "
        "`--prefill-policy`; none: `routing` routes both tiers",
    )
    data_parallel_size: int = setting(
        1,
        "with `upstream: openai` or `vllm-grpc`: the data-parallel engines of each of its "
        "(prefill) workers, vLLM servers started with `--data-parallel-size` N: each engine "
        "is a worker of its own (`ADDRESS#dpR`), its requests pinned to it, its KV events "
        "(a `kv_events` endpoint's port + R) and load followed apart, so `routing` sends a "
        "prompt to the engine that holds its prefix; 1: the server balances its engines",
        minimum=1,
        maximum=256,
    )
    adapter_of: str | None = setting(
        None,
        "this model is a LoRA adapter of that one (an `upstream: grpc` model: our workers "
        "with `--engine vllm --enable-lora`; or `upstream: openai`: vLLM servers started "
        "with `--enable-lora`): its requests go to that model's workers, "
        "which serve it by this name; it takes no `workers` (nor any worker setting) of its "
        "own (docs: Guides, LoRA adapters)",
        min_length=1,
    )
    adapter_path: str | None = setting(
        None,
        "with `adapter_of`: where the workers load the adapter from, once on each worker "
        "before its first request for it (`grpc`: our `LoadAdapter`, an absolute path of "
        "a folder on the workers' machines; `openai`: vLLM's `/v1/load_lora_adapter` "
        "`lora_path`, a directory the workers can read or a Hugging Face repository id, "
        "with `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` on the servers); none: the workers "
        "serve it from their start (`--lora-modules`), and only those listing it get its "
        "requests",
        min_length=1,
    )


@dataclass(frozen=True)
class BudgetConfig:
    """A team's (or one of its keys') allowance over a calendar window, UTC."""

    window: str = setting(REQUIRED, "the calendar window (UTC)", choices=BUDGET_WINDOWS)
    tokens: int | None = setting(
        None,
        "prompt and completion tokens together; none: not counted in tokens (a budget needs "
        "`tokens` or `spend`)",
        minimum=0,
    )
    spend: float | None = setting(
        None,
        "spend (the models' `prices` per million tokens); none: not counted in spend",
        minimum=0,
    )
    start_hour: int = setting(
        0,
        "the hour (UTC) a day window starts at, and a month window on its `start_day`",
        minimum=0,
        maximum=23,
    )
    start_day: int = setting(
        1, "the day of the month a month window starts on", minimum=1, maximum=28
    )
    key: str | None = setting(
        None,
        "the first hex digits of a key's SHA-256 (its `key_id`): the budget of that key alone; "
        "none: the team's",
        pattern=("[0-9a-f]{8,64}", "a key id (8 or more lowercase hex digits)"),
    )


@dataclass(frozen=True)
class AliasTarget:
    """One target of an alias as written, `{model, weight}`; the alias holds
    `(model, weight)`."""

    model: str = setting(REQUIRED, "a model's (or another alias's) name", min_length=1)
    weight: float = setting(1.0, "its share of the draws", minimum=0)


@dataclass(frozen=True)
class AliasConfig:
    """A model name that stands for others: `(model, weight)` targets, drawn by weight."""

    name: str = setting(REQUIRED, "the alias, a name no model has", min_length=1)
    targets: tuple[tuple[str, float], ...] = setting(
        REQUIRED,
        "its targets, `[{model, weight}]`, one drawn by weight per request (the same for one "
        "session key)",
        min_length=1,
        shape=AliasTarget,
    )


@dataclass(frozen=True)
class QueueConfig:
    """A bounded wait for a slot (`queue:`, top level or per model)."""

    max_wait: float = setting(
        REQUIRED,
        "seconds a request may wait for a slot; one that cannot have it by then gets 503",
        minimum=0.001,
    )
    max_depth: int = setting(
        1024, "requests that may wait at once, per model; one more gets 503 at once", minimum=1
    )
    max_starvation: float = setting(
        10.0, "seconds after which a waiter of any priority is served next", minimum=0.001
    )


@dataclass(frozen=True)
class TeamConfig:
    """A product team: its share of the slots, its limits (None: none), its models."""

    name: str = setting(
        REQUIRED,
        "the team's name, in metric labels and Redis keys",
        pattern=(TEAM_NAME.pattern, "a team name: letters, digits, '_', '.', '-' (64 at most)"),
    )
    weight: float = setting(
        1.0,
        "its weight in the fair share of `max_concurrent_requests` when slots are scarce",
        minimum=0.001,
    )
    max_concurrent_requests: int | None = setting(
        None, "its requests served at once; none: no limit", minimum=1
    )
    requests_per_minute: int | None = setting(
        None, "its requests a minute; none: no limit", minimum=1
    )
    tokens_per_minute: int | None = setting(
        None,
        "its tokens (prompt and completion) a minute; none: no limit",
        minimum=1,
    )
    models: tuple[str, ...] = setting(
        (), "the models its keys may use and see; none: every model", min_length=1
    )
    priority: int = setting(
        0,
        "its requests' priority in the queue (higher first); `x-furnace-priority` may lower it",
        minimum=-1000,
        maximum=1000,
    )
    budgets: tuple[BudgetConfig, ...] = setting(
        (),
        "allowances over UTC calendar windows, in tokens or spend; a spent one gets 429 "
        "`budget_exceeded` (docs: Guides, budgets)",
    )
    aliases: tuple[AliasConfig, ...] = setting(
        (),
        "the team's own aliases, shaped as the top-level `aliases`, over the top-level ones of "
        "the same name",
        keyed=True,
    )


@dataclass(frozen=True)
class KeyConfig:
    """An API key, known by the SHA-256 of its exact text (never the key), and its team."""

    sha256: bytes = setting(
        REQUIRED,
        "the SHA-256 of the key's exact text (never the key)",
        pattern=("[0-9a-fA-F]{64}", "the 64 hex digits of the key's SHA-256"),
    )
    team: str = setting(REQUIRED, "the team the key is of, one of `teams`", min_length=1)


@dataclass(frozen=True)
class WorkerTLS:
    """TLS on the gateway's gRPC channels to workers; mutual with a client certificate."""

    ca_file: str | None = setting(
        None,
        "PEM roots that sign the workers' certificates; none: the system's roots",
        min_length=1,
    )
    cert_file: str | None = setting(
        None,
        "the gateway's client certificate (PEM), for workers that ask for one; with `key_file`",
        min_length=1,
    )
    key_file: str | None = setting(None, "the key (PEM) of `cert_file`", min_length=1)
    server_name: str | None = setting(
        None,
        "the name the workers' certificates hold, when it is not their address's host",
        min_length=1,
    )


@dataclass(frozen=True)
class Config:
    """Everything `furnace-gateway serve` reads. Each field is declared once, here: its
    type, default, bounds and meaning (`setting`)."""

    host: str = setting("0.0.0.0", "the address the gateway listens on")
    port: int = setting(8000, "the port the gateway listens on", minimum=0, maximum=65535)
    admin_port: int | None = setting(
        None,
        "the port of the admin listener (`/metrics`, `/metrics/json`, `/admin/workers`, "
        "`/admin/usage`, and the probes), as Envoy's admin port; none: no admin listener, and "
        "a keyed gateway serves those routes nowhere",
        minimum=0,
        maximum=65535,
    )
    admin_host: str | None = setting(
        None, "the address the admin listener listens on; none: the same as `host`", min_length=1
    )
    allowed_hosts: tuple[str, ...] = setting(
        (),
        "host names the `Host` header may hold (others get 421; probes and metrics exempt); "
        "none: any, but only loopback names when `host` is a loopback address",
    )
    max_concurrent_requests: int = setting(
        256, "requests served at once, all routes together; one more gets 503 at once", minimum=1
    )
    low_priority_headroom: float = setting(
        0.25,
        "the share of a model's worker capacity, and of `max_concurrent_requests`, that "
        "requests of a priority below 0 (every batch line: `batch_priority`; a team's or a "
        "request's own) leave to the others: such a request that finds the workers busier "
        "than the rest is refused at once (503 `server_busy`, reason `low_priority_headroom`; "
        "a batch line is sent again later), and one that finds the slots so taken is refused "
        "too, or on a model with a queue waits in it until they are not; 0: they take what "
        "any request may",
        minimum=0,
        maximum=0.9,
    )
    request_timeout: float = setting(
        600.0,
        "seconds for a whole non-streamed answer (then 504 `timeout`), and for the wait for "
        "each streamed event (then an error payload and `[DONE]`)",
        minimum=0.001,
    )
    stream_timeout: float = setting(
        3600.0,
        "seconds a whole stream may last, passed to the worker as the gRPC deadline",
        minimum=0.001,
    )
    keepalive_interval: float = setting(
        15.0,
        "seconds of quiet in a stream (a long prefill) before a `: keep-alive` comment keeps "
        "proxies from cutting it",
        minimum=0.001,
    )
    write_timeout: float = setting(
        30.0,
        "seconds one write of an answer may wait on a client that stops reading; then the "
        "worker's call is cancelled, the slot freed and the connection closed",
        minimum=0.001,
    )
    stream_buffer_bytes: int = setting(
        1024 * 1024,
        "bytes of answer (text, logprobs, tool-call arguments) held per request for a client "
        "not yet taking them; past "
        "it the gateway stops reading from the worker, which gRPC flow control slows down",
        minimum=1,
    )
    max_output_units: int = setting(
        262_144,
        "what one request may make: `n` x `max_tokens` x (1, or 2 + `top_logprobs` with "
        "logprobs); more is a 400 naming the length the client sent (`max_tokens`, "
        "`max_completion_tokens`, `max_output_tokens`; without one, the most that "
        "fits is its `max_tokens` where the model's context could pass it)",
        minimum=1,
    )
    max_body_bytes: int = setting(
        4 * 1024 * 1024,
        "the largest request body, in bytes; a larger one gets 413 before it is read",
        minimum=1,
    )
    max_audio_bytes: int = setting(
        25 * 1024 * 1024,
        "the largest audio file `/v1/audio/transcriptions` and `/v1/audio/translations` take "
        "(OpenAI's 25 MB), in bytes; a larger upload gets 413 before it is read",
        minimum=1,
    )
    max_body_bytes_in_flight: int = setting(
        64 * 1024 * 1024,
        "bytes of request bodies this process reads at once; a body that would pass it gets "
        "503 server_busy before more of it is read (one body alone always passes)",
        minimum=1,
    )
    max_team_body_bytes_in_flight: int = setting(
        16 * 1024 * 1024,
        "bytes of request bodies one team's requests send at once; past it a 429 before more "
        "is read (one body alone always passes)",
        minimum=1,
    )
    retry_after: int = setting(1, "seconds sent in the `Retry-After` of a 503", minimum=0)
    log_level: str = setting("info", "how much the gateway logs", choices=LOG_LEVELS)
    log_format: str = setting(
        "text",
        "each line as `time level logger message` (text), or as one JSON object (json: `time`, "
        "`level`, `logger`, then an access line's fields or `message`)",
        choices=LOG_FORMATS,
    )
    log_prompts: bool = setting(False, "put prompts in the access log (never completions or keys)")
    tracing: bool = setting(
        False, "OpenTelemetry spans for requests and worker calls (the `otel` extra)"
    )
    drain_timeout: float = setting(
        30.0,
        "seconds after SIGTERM for requests in flight to finish; the rest are then cancelled",
        minimum=0,
    )
    processes: int = setting(
        1,
        "gateway processes sharing the port (SO_REUSEPORT), each with its own event loop and "
        "its share of the slots (`serve --workers N` overrides it)",
        minimum=1,
    )
    multiplex_workers: bool = setting(
        True,
        "carry every request to a worker of ours on one `GenerateMultiplexed` call where the "
        "worker offers it (one gRPC message per engine step, not per request); false: one "
        "`Generate` call per request",
    )
    discovery_interval: float = setting(
        10.0, "seconds between DNS lookups of `dns:` worker names", minimum=0.01
    )
    health_check_interval: float = setting(
        5.0,
        "seconds between health checks of workers that cannot be watched (and the most a "
        "reconnect waits)",
        minimum=0.01,
    )
    health_check_timeout: float = setting(
        5.0,
        "seconds one health check of a worker may take before the worker counts as "
        "unreachable, whatever `health_check_interval` is (a short interval does not make "
        "a slow answer a failure)",
        minimum=0.01,
    )
    start_timeout: float = setting(
        10.0,
        "seconds a worker may take to start an answer (its first event) before another worker "
        "is tried",
        minimum=0.001,
    )
    eject_after_failures: int = setting(
        3,
        "consecutive transport failures (unreachable, internal error, deadline) that eject a "
        "worker",
        minimum=1,
    )
    eject_base: float = setting(
        1.0,
        "seconds of a first ejection; each further one in a row doubles it, up to `eject_max`",
        minimum=0,
    )
    eject_max: float = setting(60.0, "the most seconds an ejection lasts", minimum=0)
    retry_attempts: int = setting(
        3, "tries per request, the first included; only before the worker's first event", minimum=1
    )
    retry_budget: float = setting(
        0.2, "retries allowed, as a fraction of requests over the last 10 s (plus 3)", minimum=0
    )
    retry_backoff: float = setting(
        0.025,
        "seconds: the scale of the jittered exponential back-off between tries",
        minimum=0,
    )
    affinity_prefix_chars: int = setting(
        256, "characters of the prompt that `prefix_affinity` hashes", minimum=1
    )
    affinity_load_factor: float = setting(
        1.25,
        "with `prefix_affinity`, no worker takes more than this times the average load",
        minimum=1,
    )
    max_messages: int = setting(2048, "most messages in one chat request; more get 400", minimum=1)
    max_header_bytes: int = setting(
        32 * 1024,
        "the largest total size of a request's headers, in bytes; larger get 431",
        minimum=1024,
    )
    max_headers: int = setting(
        100, "most headers in one request; more get 431 (Envoy's default)", minimum=1
    )
    header_timeout: float = setting(
        30.0,
        "seconds for a request's whole request line and headers, from the connection's start "
        "or the previous response's end; then 408 and close (silent connections: close)",
        minimum=0.001,
    )
    body_timeout: float = setting(
        60.0,
        "seconds for a request's whole body, from the end of its headers; then 408 and the "
        "request is dropped",
        minimum=0.001,
    )
    max_connections: int = setting(
        0,
        "open client connections at once (0: three quarters of the process's open-file limit); "
        "past half of it the header timeout shrinks toward 1 s, and when full a new one closes "
        "the oldest without a whole request head, else gets 503",
        minimum=0,
    )
    keys: tuple[KeyConfig, ...] = setting(
        (),
        "API keys by their SHA-256 (`[{sha256, team}]`); no keys (and no `keys_file`): the "
        "gateway is open to anyone who reaches it",
    )
    keys_file: str | None = setting(
        None,
        "a YAML file of more keys (a list shaped like `keys`), e.g. from a Kubernetes Secret; "
        "read again when it changes",
        min_length=1,
    )
    teams: tuple[TeamConfig, ...] = setting(
        (),
        "product teams by name: their share of the slots, their limits, their models",
        keyed=True,
    )
    redis_url: str | None = setting(
        None,
        "Redis (`redis://`, `rediss://`, `unix://`) holding the teams' limits for every "
        "replica; none: each gateway's memory",
        min_length=1,
    )
    redis_timeout: float = setting(
        0.25,
        "seconds for each Redis call; past it the gateway serves with its local limits",
        minimum=0.001,
    )
    redis_lease_ttl: float = setting(
        10.0,
        "seconds a request's concurrency lease lives in Redis unless its gateway renews "
        "it (every third of this): how long a replica killed without draining keeps "
        "counting its requests against their teams' `max_concurrent_requests`",
        minimum=2.0,
    )
    redis_key_prefix: str = setting(
        "furnace",
        "prefix of the Redis keys, so gateways of several deployments can share a Redis",
        min_length=1,
    )
    responses_ttl: float = setting(
        2_592_000,  # 30 days, as OpenAI keeps them
        "seconds a stored response (/v1/responses, `store`) is kept, and a conversation "
        "after its last change, in Redis with `redis_url`, else in the gateway's memory",
        minimum=1,
    )
    responses_per_team: int = setting(
        10_000, "most stored responses per team; past it the oldest are dropped", minimum=1
    )
    responses_max_depth: int = setting(
        256,
        "most turns of a conversation continued by `previous_response_id`; deeper gets 400",
        minimum=1,
    )
    conversations_per_team: int = setting(
        10_000,
        "most conversations (/v1/conversations, the Responses API's `conversation`) per "
        "team; past it the least recently changed are dropped",
        minimum=1,
    )
    conversations_max_items: int = setting(
        1_000,
        "most items of one conversation; adding past it gets 400 (a turn's answer is "
        "added whole after an input that fit)",
        minimum=1,
    )
    responses_max_background: int = setting(
        64,
        "most background responses (`background: true`) a team runs at once on a replica; "
        "past it 429",
        minimum=1,
    )
    batch_max_file_bytes: int = setting(
        100 * 1024 * 1024,
        "the largest file uploaded to /v1/files (the Batch API's input), in bytes; larger gets 413",
        minimum=1,
    )
    batch_max_requests: int = setting(
        50_000, "most requests in one batch's input file (OpenAI's bound)", minimum=1
    )
    batch_concurrency: int = setting(
        32,
        "most requests of all batches a gateway process sends at once (each through "
        "admission as any request)",
        minimum=1,
    )
    batch_priority: int = setting(
        -100,
        "the priority a batch's requests ask in the queue (`x-furnace-priority`; the team's "
        "own caps it): below interactive requests by default",
        minimum=-1000,
        maximum=1000,
    )
    batch_ttl: float = setting(
        2_592_000,  # 30 days, as OpenAI keeps batch files
        "seconds files (/v1/files) and batches (/v1/batches) are kept, in Redis with "
        "`redis_url`, else in the gateway's memory",
        minimum=1,
    )
    batch_files_per_team: int = setting(
        1_000, "most files a team keeps; an upload past it gets 400", minimum=1
    )
    mcp_allowed_urls: tuple[str, ...] = setting(
        (),
        "the remote MCP servers requests may name (the Responses API's `mcp` tools, "
        "Anthropic's `mcp_servers`), as URL prefixes (`https://mcp.example.com/`): the "
        "gateway lists their tools and calls them for the model; a URL under none is a 400 "
        "naming it; none: every MCP server is refused (docs: the Responses API, remote MCP)",
        min_length=1,
    )
    mcp_timeout: float = setting(
        30.0,
        "seconds one step with an MCP server may take (listing its tools, one tool call), "
        "within the request's own deadline",
        minimum=0.001,
    )
    # (a frozen dataclass: immutable, though ruff cannot tell)
    queue: QueueConfig | None = setting(  # noqa: RUF009
        None,
        "a bounded wait for a slot, `{max_wait, max_depth, max_starvation}` (seconds, "
        "requests per model, seconds); each model may override it; none: a full gateway "
        "refuses at once",
    )
    # (a frozen dataclass: immutable, though ruff cannot tell)
    worker_tls: WorkerTLS | None = setting(  # noqa: RUF009
        None,
        "TLS to gRPC workers: `ca_file`, `cert_file` and `key_file` (mutual), `server_name`",
    )
    models: tuple[ModelConfig, ...] = setting(
        (), "the models served, in order (the first LLM is the default): see `models[]` below"
    )
    aliases: tuple[AliasConfig, ...] = setting(
        (),
        "model names that stand for others, `{name: [{model, weight}]}`: a request is served by "
        "one target, drawn by weight (the same for one session key)",
        keyed=True,
    )
    budget_store_failure: str = setting(
        "open",
        "what budgets do while Redis does not answer: `open` counts on in this gateway's "
        "memory (and adds it to Redis once it answers), `closed` refuses with 503",
        choices=STORE_FAILURE_MODES,
    )
    usage_retention_days: int = setting(
        90, "days the usage ledger keeps in Redis (`/admin/usage`)", minimum=1, maximum=3660
    )


#: Each top-level field's declaration, by name, in declaration order.
SPECS: dict[str, Spec] = {declared.name: spec_of(declared) for declared in fields(Config)}
#: Each top-level field's type (`int`, `float`, `str`, ...), by name.
TYPES: dict[str, Any] = get_type_hints(Config)
#: Fields whose environment override is YAML (a list or a mapping).
_STRUCTURED = (
    "models",
    "teams",
    "keys",
    "worker_tls",
    "allowed_hosts",
    "queue",
    "aliases",
    "mcp_allowed_urls",
)


def hints(section: Any) -> dict[str, Any]:
    """The types of a section's fields, by name."""
    return get_type_hints(section)


def optional(hint: Any) -> tuple[Any, bool]:
    """`X | None` as (X, True); any other type as (it, False)."""
    args = get_args(hint)
    if type(None) not in args:
        return hint, False
    (inner,) = (arg for arg in args if arg is not type(None))
    return inner, True


def is_section(hint: Any) -> bool:
    """Whether `hint` is a section: a dataclass of declared fields."""
    return isinstance(hint, type) and is_dataclass(hint)


def item_of(hint: Any) -> Any:
    """The item type of `tuple[X, ...]`, else None."""
    args = get_args(hint)
    return args[0] if get_origin(hint) is tuple and args[-1:] == (Ellipsis,) else None


def _number(name: str, value: Any, kind: type, minimum: float, maximum: float | None = None) -> Any:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ConfigError(f"{name}: expected a number, got {value!r}")
    try:
        number = kind(value)
    except (ValueError, OverflowError):  # OverflowError: int(inf)
        raise ConfigError(f"{name}: expected a number, got {value!r}") from None
    if number != number:  # NaN passes both bounds
        raise ConfigError(f"{name}: expected a number, got {value!r}")
    if kind is int and isinstance(value, float) and value != number:
        raise ConfigError(f"{name}: expected a whole number, got {value!r}")
    if number < minimum:
        raise ConfigError(f"{name}: must be at least {minimum}, got {value!r}")
    if maximum is not None and number > maximum:
        raise ConfigError(f"{name}: must be at most {maximum}, got {value!r}")
    return number


def _text(name: str, value: Any, spec: Spec) -> str:
    """A string checked against its `Spec`; never repeated in the error (it may be a secret)."""
    if spec.choices:
        text = str(value).lower()
        if text not in spec.choices:
            raise ConfigError(f"{name}: expected one of {', '.join(spec.choices)}")
        return text
    if not isinstance(value, str) or len(value) < spec.min_length:
        wanted = "a non-empty string" if spec.min_length else "a string"
        raise ConfigError(f"{name}: expected {wanted}")
    if spec.pattern is not None and not re.fullmatch(spec.pattern[0], value):
        raise ConfigError(f"{name}: expected {spec.pattern[1]}")
    return value


def _flag(name: str, value: Any) -> bool:
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    if not isinstance(value, bool):
        raise ConfigError(f"{name}: expected true or false, got {value!r}")
    return value


def _at(where: str, name: Any) -> str:
    return f"{where}.{name}" if where else str(name)


def _shown(section: type) -> str:
    return "{" + ", ".join(f.name for f in fields(section)) + "}"


def _value(where: str, hint: Any, spec: Spec, raw: Any) -> Any:
    """`raw` checked against a field's type and `Spec`; `where` is its full path."""
    hint, nullable = optional(hint)
    if nullable and raw is None:
        return None
    item = item_of(hint)
    if spec.shape is not None:
        if item is None:
            return astuple(_section(where, raw, spec.shape))
        return tuple(astuple(entry) for entry in _sections(where, raw, spec.shape, spec))
    if is_section(hint):
        return _section(where, raw, hint)
    if item is None:
        return _scalar(where, hint, spec, raw)
    if is_section(item):
        return _sections(where, raw, item, spec)
    if raw is None:  # an empty list or mapping may be written as nothing
        return ()
    if get_origin(item) is tuple:  # `{name: value}` as (name, value) pairs
        kind = get_args(item)[1]
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{where}: expected a mapping of name to {kind.__name__}")
        return tuple((str(k), _scalar(_at(where, k), kind, spec, v)) for k, v in raw.items())
    if not isinstance(raw, list):
        raise ConfigError(f"{where}: expected a list")
    return tuple(_scalar(f"{where}[{i}]", item, spec, entry) for i, entry in enumerate(raw))


def _scalar(where: str, hint: Any, spec: Spec, raw: Any) -> Any:
    if hint is bool:
        return _flag(where, raw)
    if hint in (int, float):
        minimum = 0 if spec.minimum is None else spec.minimum
        return _number(where, raw, hint, minimum, spec.maximum)
    if hint is str:
        return _text(where, raw, spec)
    if hint is bytes:  # written as hex digits
        return bytes.fromhex(_text(where, raw, spec))
    raise TypeError(f"{where}: no check for {hint!r}")


def _fields(where: str, raw: Any, section: type[Any], skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """The fields of `section` that `raw` (a mapping) gives, each checked; `skip`: fields
    the caller checks."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: expected a mapping {_shown(section)}")
    declared = {f.name: f for f in fields(section)}
    unknown = sorted(str(name) for name in raw if name not in declared)
    if unknown:
        raise ConfigError(f"{_at(where, unknown[0])}: unknown field")
    types = hints(section)
    return {
        name: _value(_at(where, name), types[name], spec_of(f), raw[name])
        for name, f in declared.items()
        if name in raw and name not in skip
    }


def _built(where: str, section: type[_T], values: dict[str, Any]) -> _T:
    """`section` from checked `values`; a required field missing is an error."""
    for f in fields(section):  # type: ignore[arg-type]
        if f.default is MISSING and f.name not in values:
            raise ConfigError(f"{_at(where, f.name)}: required")
    return section(**values)


def _section(where: str, raw: Any, section: type[_T]) -> _T:
    """A section (a mapping of its declared fields), each field checked."""
    return _built(where, section, _fields(where, raw, section))


def _sections(where: str, raw: Any, section: type[Any], spec: Spec) -> tuple[Any, ...]:
    """A list of sections, or with `spec.keyed` a mapping keyed by their first field."""
    if raw is None:
        return ()
    key, *rest = fields(section)
    if not spec.keyed:
        if not isinstance(raw, list) or len(raw) < spec.min_length:
            raise ConfigError(f"{where}: expected a list of {_shown(section)}")
        return tuple(_section(f"{where}[{i}]", entry, section) for i, entry in enumerate(raw))
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: expected a mapping of {key.name} to its settings")
    types = hints(section)
    found = []
    for name, value in raw.items():
        at = _at(where, name)
        values = {key.name: _value(at, types[key.name], spec_of(key), name)}
        if len(rest) == 1:  # the value is the only other field
            values[rest[0].name] = _value(at, types[rest[0].name], spec_of(rest[0]), value)
        else:
            value = {} if value is None else value
            if isinstance(value, Mapping) and key.name in value:
                raise ConfigError(f"{_at(at, key.name)}: unknown field")
            values.update(_fields(at, value, section))
        found.append(_built(at, section, values))
    return tuple(found)


def _host_names(raw: Any) -> tuple[str, ...]:
    """`allowed_hosts`: a list of names (or one string of comma-separated names)."""
    if isinstance(raw, str):
        raw = raw.split(",")
    if raw is None:
        return ()
    if not isinstance(raw, list | tuple) or not all(isinstance(h, str) and h.strip() for h in raw):
        raise ConfigError("allowed_hosts: expected a list of host names")
    return tuple(h.strip().strip("[]").rstrip(".").lower() for h in raw)


def _queue(where: str, raw: Any, base: QueueConfig | None) -> QueueConfig | None:
    """A model's `queue`: its fields over the top-level `base`."""
    if raw is None:
        return base
    if base is None:
        return _section(where, raw, QueueConfig)
    return replace(base, **_fields(where, raw, QueueConfig))


def _model(where: str, raw: Any, queue: QueueConfig | None) -> ModelConfig:
    """One `models[]` entry: its declared fields, then what they require of each other."""
    values = _fields(where, raw, ModelConfig, skip=("queue",))
    values["queue"] = _queue(f"{where}.queue", raw.get("queue"), queue)
    if values.get("kind") == "tensor":
        values.setdefault("upstream", "kserve-grpc")
    model = _built(where, ModelConfig, values)
    if model.adapter_of is not None:
        return _adapter(where, raw, model)
    if model.adapter_path is not None:
        raise ConfigError(f"{where}.adapter_path: only with adapter_of")
    if model.kind == "llm" and not model.workers:
        raise ConfigError(f"{where}.workers: an llm model needs at least one worker")
    if (model.kind == "tensor") != (model.upstream == "kserve-grpc"):
        raise ConfigError(f"{where}.upstream: kserve-grpc is for kind: tensor models, and only it")
    _tokenizer_dir(where, model.tokenizer, model.upstream)
    if model.scoring == "cross-encoder" and model.upstream != "openai":
        raise ConfigError(
            f"{where}.scoring: cross-encoder with upstream: openai (the workers' /rerank)"
        )
    if model.tool_call_parser is not None and model.upstream != "vllm-grpc":
        raise ConfigError(
            f"{where}.tool_call_parser: with upstream: vllm-grpc, one of "
            f"{', '.join(TOOL_CALL_PARSERS)}"
        )
    if model.reasoning_parser is not None and model.upstream != "vllm-grpc":
        raise ConfigError(
            f"{where}.reasoning_parser: with upstream: vllm-grpc (an OpenAI-compatible "
            "server parses its own), one of " + ", ".join(REASONING_PARSERS)
        )
    for i, entry in enumerate(model.workers):
        is_url = entry.startswith(("http://", "https://"))
        if is_url != (model.upstream == "openai"):
            expected = (
                "an http(s):// base URL" if model.upstream == "openai" else "host:port or dns:"
            )
            raise ConfigError(f"{where}.workers[{i}]: expected {expected}, got {entry!r}")
    for i, entry in enumerate(model.prefill_workers):
        is_url = entry.startswith(("http://", "https://"))
        if model.upstream not in PREFILL_UPSTREAMS or is_url != (model.upstream == "openai"):
            raise ConfigError(
                f"{where}.prefill_workers[{i}]: with upstream: openai, an http(s):// base URL; "
                f"with upstream: vllm-grpc, host:port or dns:; got {entry!r}"
            )
    if model.data_parallel_size > 1 and model.upstream not in DATA_PARALLEL_UPSTREAMS:
        raise ConfigError(
            f"{where}.data_parallel_size: with upstream: openai or vllm-grpc (vLLM's servers)"
        )
    for entry, _ in model.weights:
        if entry not in model.workers:
            raise ConfigError(f"{where}.weights.{entry}: not one of the model's workers")
    if model.prefill_routing is not None and not model.prefill_workers:
        raise ConfigError(f"{where}.prefill_routing: only with prefill_workers")
    # each tier's ZMQ publishers: the prefill workers' in `prefill_routing` when it is set
    tiers = ("workers", "prefill_workers") if model.prefill_routing is None else ("workers",)
    _kv_events(where, "routing", model, tiers)
    _kv_events(where, "prefill_routing", model, ("prefill_workers",))
    _upstream_credentials(where, model)
    return model


def _kv_events(where: str, name: str, model: ModelConfig, tiers: tuple[str, ...]) -> None:
    """The model's routing `name`: its `kv_events` name `upstream: openai` entries of the
    model's `tiers`, with the model's tokenizer; its `kv_replay`, entries of `kv_events`."""
    routing: RoutingConfig | None = getattr(model, name)
    if routing is None:
        return
    entries = [entry for tier in tiers for entry in getattr(model, tier)]
    for entry, _ in routing.kv_events:
        if model.upstream != "openai" or entry not in entries:
            raise ConfigError(
                f"{where}.{name}.kv_events.{entry}: not one of the model's upstream: openai "
                + " or ".join(tiers)
            )
        if model.tokenizer is None:
            raise ConfigError(f"{where}.tokenizer: required with {name}.kv_events")
    events = dict(routing.kv_events)
    for entry, _ in routing.kv_replay:
        if entry not in events:
            raise ConfigError(
                f"{where}.{name}.kv_replay.{entry}: not one of {name}.kv_events' workers"
            )


#: The upstreams whose servers prefill for others to decode (vLLM's OpenAI and gRPC
#: servers, with its NixlConnector: `Prefills`).
PREFILL_UPSTREAMS = ("openai", "vllm-grpc")
#: The upstreams whose servers run data-parallel engines a request can be pinned to
#: (vLLM's OpenAI and gRPC servers: `gateway.fleet.data_parallel`).
DATA_PARALLEL_UPSTREAMS = ("openai", "vllm-grpc")
#: The upstreams whose workers serve adapters and load them when asked (`LoadsAdapters`).
ADAPTER_UPSTREAMS = ("grpc", "openai")
#: What an adapter's entry may set: the rest is its base model's (`_adapters`).
ADAPTER_FIELDS = frozenset(
    {"name", "adapter_of", "adapter_path", "max_tokens_limit", "queue", "fallbacks", "prices"}
)


def _adapter(where: str, raw: Mapping[str, Any], model: ModelConfig) -> ModelConfig:
    """An adapter's entry: only its own fields (`ADAPTER_FIELDS`); its base fills the
    rest once every model is read (`_adapters`)."""
    other = sorted(str(name) for name in raw if name not in ADAPTER_FIELDS)
    if other:
        raise ConfigError(
            f"{_at(where, other[0])}: an adapter takes its base model's (`adapter_of`); "
            f"an adapter sets only {', '.join(sorted(ADAPTER_FIELDS))}"
        )
    return model


def _adapters(models: tuple[ModelConfig, ...]) -> tuple[ModelConfig, ...]:
    """Each adapter with its base's worker settings (its workers, the upstream and what
    reaching it takes, the balance, the context) and, where it sets none of its own, its
    base's `max_tokens_limit` and `prices`; checked: the base is an LLM model of an
    `ADAPTER_UPSTREAMS` upstream that is not itself an adapter."""
    by_name = {m.name: m for m in models}
    done = []
    for i, model in enumerate(models):
        base = by_name.get(model.adapter_of) if model.adapter_of is not None else None
        if model.adapter_of is None:
            done.append(model)
            continue
        where = f"models[{i}].adapter_of"
        if base is None or base is model:
            raise ConfigError(f"{where}: not another model: {model.adapter_of!r}")
        if base.adapter_of is not None:
            raise ConfigError(f"{where}: {base.name!r} is itself an adapter")
        if base.kind != "llm" or base.upstream not in ADAPTER_UPSTREAMS:
            raise ConfigError(
                f"{where}: {base.name!r} is not an `upstream: grpc` or `upstream: openai` LLM "
                "model (the gateway loads adapters through our workers' LoadAdapter or vLLM's "
                "HTTP server; vLLM's gRPC server and KServe take none)"
            )
        done.append(
            replace(
                model,
                upstream=base.upstream,
                workers=base.workers,
                weights=base.weights,
                balance=base.balance,
                max_model_len=base.max_model_len,
                api_key_env=base.api_key_env,
                ca_file=base.ca_file,
                max_tokens_limit=(
                    base.max_tokens_limit
                    if model.max_tokens_limit is None
                    else model.max_tokens_limit
                ),
                prices=base.prices if model.prices is None else model.prices,
            )
        )
    return tuple(done)


def _tokenizer_dir(where: str, value: str | None, upstream: str) -> None:
    """`tokenizer`: required with `vllm-grpc`, a directory whose tokenizer files can be read."""
    if value is None:
        if upstream == "vllm-grpc":
            raise ConfigError(f"{where}.tokenizer: required with upstream: vllm-grpc")
        return
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if not os.access(Path(value, name), os.R_OK):
            raise ConfigError(f"{where}.tokenizer: cannot read {name} in {value}")


def _upstream_credentials(where: str, model: ModelConfig) -> None:
    """`api_key_env` names a variable that is set; `ca_file` is readable; both for `openai`."""
    for name in ("api_key_env", "ca_file"):
        if getattr(model, name) is not None and model.upstream != "openai":
            raise ConfigError(f"{where}.{name}: only for `upstream: openai`")
    if model.api_key_env is not None and not os.environ.get(model.api_key_env):
        raise ConfigError(
            f"{where}.api_key_env: the environment variable {model.api_key_env} is not set"
        )
    if model.ca_file is not None:
        try:
            Path(model.ca_file).read_bytes()
        except OSError as error:
            raise ConfigError(
                f"{where}.ca_file: cannot read {model.ca_file}: {error.strerror}"
            ) from None


def _routing(values: dict[str, Any]) -> None:
    """Checks the aliases (top level and each team's) and the models' fallbacks: every
    name a model or an alias, no alias named as a model, no alias reaching itself."""
    models = {m.name for m in values["models"]}
    top = {a.name: a for a in values["aliases"]}
    scopes = [("aliases", top)]
    scopes += [(f"teams.{t.name}.aliases", {a.name: a for a in t.aliases}) for t in values["teams"]]
    for where, aliases in scopes:
        known = {**top, **aliases}
        for name, alias in aliases.items():
            if name in models:
                raise ConfigError(f"{where}.{name}: a model has this name")
            for i, (target, _) in enumerate(alias.targets):
                if target not in models and target not in known:
                    raise ConfigError(f"{where}.{name}[{i}].model: unknown model {target!r}")
            if sum(weight for _, weight in alias.targets) <= 0:
                raise ConfigError(f"{where}.{name}: the weights sum to 0")
            _no_cycle(f"{where}.{name}", name, known, ())
    for i, model in enumerate(values["models"]):
        if model.fallbacks and model.kind == "tensor":
            raise ConfigError(
                f"models[{i}].fallbacks: a tensor model has no fallbacks (another model's "
                "inputs and outputs differ)"
            )
        for j, target in enumerate(model.fallbacks):
            if target == model.name or (target not in models and target not in top):
                raise ConfigError(f"models[{i}].fallbacks[{j}]: not another model: {target!r}")


def _no_cycle(
    where: str, name: str, aliases: Mapping[str, AliasConfig], path: tuple[str, ...]
) -> None:
    if name in path:
        raise ConfigError(f"{where}: an alias cycle: {' -> '.join((*path, name))}")
    alias = aliases.get(name)
    for target, _ in alias.targets if alias is not None else ():
        _no_cycle(where, target, aliases, (*path, name))


def _teams(values: dict[str, Any]) -> None:
    """Checks what each team names: configured models, budgets in tokens or spend."""
    models = {m.name for m in values["models"]}
    for team in values["teams"]:
        where = f"teams.{team.name}"
        for i, model in enumerate(team.models):
            if model not in models:
                raise ConfigError(f"{where}.models[{i}]: {model!r} is not a configured model")
        for i, budget in enumerate(team.budgets):
            if budget.tokens is None and budget.spend is None:
                raise ConfigError(f"{where}.budgets[{i}].tokens: a budget needs tokens or spend")


def parse_keys(where: str, raw: Any, teams: set[str]) -> tuple[KeyConfig, ...]:
    """Checked key entries (`[{sha256, team}]`); `where` names the field in errors.
    Errors never repeat a value: a key pasted where its hash belongs stays out of logs."""
    keys: tuple[KeyConfig, ...] = _value(where, TYPES["keys"], SPECS["keys"], raw)
    for i, key in enumerate(keys):
        if key.team not in teams:
            raise ConfigError(f"{where}[{i}].team: not one of the teams listed in `teams`")
        if any(k.sha256 == key.sha256 for k in keys[:i]):
            raise ConfigError(f"{where}[{i}].sha256: the same key is listed twice")
    return keys


def load_keys_file(path: str, teams: set[str]) -> tuple[KeyConfig, ...]:
    """The keys in `keys_file` (a YAML list shaped like `keys`, or `{keys: [...]}`)."""
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except OSError as error:
        raise KeysFileUnreadable(f"keys_file: cannot read {path}: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"keys_file: {path} is not valid YAML{_yaml_where(error)}") from None
    if isinstance(raw, Mapping) and set(raw) == {"keys"}:
        raw = raw["keys"]
    return parse_keys("keys_file", raw or [], teams)


def merge_keys(inline: tuple[KeyConfig, ...], from_file: tuple[KeyConfig, ...]) -> dict[bytes, str]:
    """Every key's team, from `keys` and `keys_file`; a key in both with two teams
    is an error (neither may silently win)."""
    teams = {k.sha256: k.team for k in inline}
    for i, key in enumerate(from_file):
        if teams.setdefault(key.sha256, key.team) != key.team:
            raise ConfigError(f"keys_file[{i}].sha256: listed in `keys` with another team")
    return teams


def _worker_tls(tls: WorkerTLS | None) -> None:
    """`worker_tls`: a certificate goes with its key, and every file can be read."""
    if tls is None:
        return
    if (tls.cert_file is None) != (tls.key_file is None):
        raise ConfigError("worker_tls.key_file: cert_file and key_file go together")
    for name in ("ca_file", "cert_file", "key_file"):
        path = getattr(tls, name)
        if path is not None and not os.access(path, os.R_OK):
            raise ConfigError(f"worker_tls.{name}: cannot read {path}")


def _keys_and_redis(values: dict[str, Any], keys: Any) -> None:
    """Checks `keys` and `keys_file` against the teams, and the scheme of `redis_url`."""
    names = {team.name for team in values["teams"]}
    values["keys"] = parse_keys("keys", keys, names)
    keys_file = values.get("keys_file")
    if keys_file is not None:
        merge_keys(values["keys"], load_keys_file(keys_file, names))
    url = values.get("redis_url")
    # never echo the URL: it may hold a password
    if url is not None and not url.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigError("redis_url: expected a redis://, rediss:// or unix:// URL")


def parse_config(raw: Mapping[str, Any], env: Mapping[str, str] | None = None) -> Config:
    """Builds a checked `Config` from a YAML mapping and environment overrides: each field
    against its declaration, then what fields require of each other."""
    env = os.environ if env is None else env
    if not isinstance(raw, Mapping):
        raise ConfigError("config: expected a mapping at the top level")
    merged = dict(raw)
    for name in SPECS:
        override = env.get(ENV_PREFIX + name.upper())
        if override is not None:
            merged[name] = yaml.safe_load(override) if name in _STRUCTURED else override
    values = _fields("", merged, Config, skip=("models", "allowed_hosts", "keys"))
    admin_port = values.get("admin_port")
    if admin_port is not None and admin_port != 0 and admin_port == values.get("port", Config.port):
        raise ConfigError("admin_port: must differ from port")
    values["allowed_hosts"] = _host_names(merged.get("allowed_hosts"))
    models = merged.get("models") or []
    if not isinstance(models, list):
        raise ConfigError("models: expected a list")
    queue = values.get("queue")
    values["models"] = tuple(_model(f"models[{i}]", m, queue) for i, m in enumerate(models))
    names = [m.name for m in values["models"]]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ConfigError(f"models[{i}].name: {name!r} is listed twice")
    values["models"] = _adapters(values["models"])
    values.setdefault("teams", ())
    values.setdefault("aliases", ())
    _teams(values)
    _keys_and_redis(values, merged.get("keys"))
    _worker_tls(values.get("worker_tls"))
    _routing(values)
    for i, url in enumerate(values.get("mcp_allowed_urls", ())):
        # a host ends at its `/`: `https://mcp.example.com` would allow mcp.example.com.evil
        scheme, _, rest = url.partition("://")
        if scheme not in ("http", "https") or "/" not in rest.lstrip("/"):
            raise ConfigError(
                f"mcp_allowed_urls[{i}]: expected an http(s) URL prefix that ends its host "
                f"with `/` (`https://mcp.example.com/`), got {url[:200]!r}"
            )
    return Config(**values)


def _yaml_where(error: yaml.YAMLError) -> str:
    """Where a YAML error is and what it is, without the text around it (its
    snippet would print the line, secrets included)."""
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{where}: {problem}" if problem else where


def load_config(path: str | Path, env: Mapping[str, str] | None = None) -> Config:
    """Reads and checks a YAML config file."""
    try:
        raw = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as error:
        raise ConfigError(f"config: cannot read {path}: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"config: {path} is not valid YAML{_yaml_where(error)}") from None
    return parse_config(raw, env)
