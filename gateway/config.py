"""The gateway's configuration: one YAML file, environment overrides, checked at
start with an error that names the field.

Every field has a safe, finite default. An environment variable
`FURNACE_<FIELD>` (upper case) overrides a top-level scalar field, and
`FURNACE_MODELS` (`_TEAMS`, `_KEYS`, `_WORKER_TLS`) may hold the whole field as YAML.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import Field, dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar, get_type_hints

import yaml

ENV_PREFIX = "FURNACE_"
MODEL_KINDS = ("llm", "tensor")
BALANCE_POLICIES = ("least_outstanding", "prefix_affinity")
#: Team names go into metric labels and Redis keys: keep them plain.
TEAM_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
UPSTREAMS = ("grpc", "openai", "vllm-grpc", "kserve-grpc")
#: The tool-call formats of `vllm-grpc` models (gateway.protocol.tool_calls.PARSERS).
TOOL_CALL_PARSERS = ("hermes", "llama3_json")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
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
    """A config field's bounds and meaning, declared once on the field: the loader checks
    them, and deploy/config_schema.py writes them into the chart's values schema and the
    configuration table of the docs."""

    #: One line: what the field does, for the docs and the values schema.
    help: str
    #: The least value a number may take (inclusive).
    minimum: int | float | None = None
    #: The largest value a number may take (inclusive); None: no bound.
    maximum: int | float | None = None
    #: The values a string may take (the loader lowercases it first).
    choices: tuple[str, ...] = ()
    #: The shortest a string may be.
    min_length: int = 0


def setting(
    default: _T,
    help: str,
    *,
    minimum: int | float | None = None,
    maximum: int | float | None = None,
    choices: tuple[str, ...] = (),
    min_length: int = 0,
) -> _T:
    """A dataclass field with its default and its `Spec`."""
    spec = Spec(help, minimum, maximum, choices, min_length)
    return field(default=default, metadata={"spec": spec})


def spec_of(declared: Field[Any]) -> Spec:
    """The `Spec` a field was declared with."""
    spec = declared.metadata.get("spec")
    if not isinstance(spec, Spec):
        raise TypeError(f"{declared.name}: declared without setting()")
    return spec


#: `models[].routing.policy` values (`gateway.fleet.routing`).
ROUTING_POLICIES = ("kv_aware", "prefix", "least_load", "round_robin")


@dataclass(frozen=True)
class RoutingConfig:
    """`models[].routing`: the scheduler over the engines' KV events and load records
    (`gateway.fleet.routing` has the cost; docs/concepts/routing.md the why)."""

    #: `kv_aware` (cached prefix and queued work), `prefix` (prefix_affinity), `least_load`
    #: (queued work only), or `round_robin`.
    policy: str = "kv_aware"
    #: Cost of one prompt token the worker's cache does not hold (prefill to do).
    prefill_weight: float = 1.0
    #: Cost of one uncached prompt token waiting in the worker's queue.
    queue_weight: float = 1.0
    #: Cost, in prompt tokens, of one request the worker runs.
    running_cost: float = 64.0
    #: Cost, in prompt tokens, of a worker whose KV cache is full (scaled by its use).
    usage_cost: float = 256.0
    #: A session stays on its worker while that worker has at most this many times the
    #: model's average calls in flight (plus one); past it the session moves.
    session_load_factor: float = 1.5
    #: Sessions remembered (least recently used forgotten first).
    max_sessions: int = 100_000
    #: KV blocks remembered per worker (oldest forgotten first).
    max_blocks_per_worker: int = 200_000


@dataclass(frozen=True)
class ModelConfig:
    """A model and the workers that serve it."""

    name: str
    kind: str = "llm"
    #: `host:port` addresses, or `dns:///name:port` (`dns://server:port/name:port`
    #: asks that name server) for a Kubernetes headless Service.
    workers: tuple[str, ...] = ()
    max_model_len: int | None = None
    #: `least_outstanding` (power of two choices) or `prefix_affinity`.
    balance: str = "least_outstanding"
    #: Relative weights by worker entry (as listed in `workers`); default 1.
    weights: tuple[tuple[str, float], ...] = ()
    #: `grpc` (our worker protocol), `openai`: workers are base URLs
    #: (`http://host:port/v1`) of OpenAI-compatible servers, or `vllm-grpc`:
    #: vLLM's own gRPC server, which takes token ids (see `tokenizer`), or
    #: `kserve-grpc`: KServe v2 gRPC servers (Triton, KServe), the default and only
    #: upstream of `kind: tensor` models.
    upstream: str = "grpc"
    #: A directory holding the model's tokenizer.json, tokenizer_config.json and
    #: chat template, for `vllm-grpc` (the gateway tokenizes); unused otherwise.
    tokenizer: str | None = None
    #: `vllm-grpc`: the format the model writes tool calls in (`hermes`, `llama3_json`),
    #: as vLLM's `--tool-call-parser`; None: it takes no tools (forced calls neither).
    tool_call_parser: str | None = None
    #: `vllm-grpc`: special-token strings a user types in a message (`<|im_end|>`) stay
    #: text when the gateway tokenizes; false: they become the real tokens, as HF's and
    #: vLLM's own front ends make them (a user could then end their turn and open a
    #: system one).
    plain_text_contents: bool = True
    #: The largest `max_tokens` a request may ask for (also its default); None: no cap.
    max_tokens_limit: int | None = None
    #: `openai` upstreams: the NAME of the environment variable holding their bearer
    #: key (sent as `Authorization: Bearer`); never the key itself.
    api_key_env: str | None = None
    #: `openai` upstreams: a PEM bundle that verifies their TLS; None: the system's roots.
    ca_file: str | None = None
    #: Its queue (the top-level `queue` with these fields overridden); None: no queue.
    queue: QueueConfig | None = None
    #: Models (or aliases) tried in order when this one cannot start an answer.
    fallbacks: tuple[str, ...] = ()
    #: Spend per million tokens: (prompt, completion), for budgets in `spend`; None: 0.
    prices: tuple[float, float] | None = None
    #: Routing on the engines' KV events and load; None: `balance` as it is.
    routing: RoutingConfig | None = None


@dataclass(frozen=True)
class BudgetConfig:
    """A team's (or one of its keys') allowance over a calendar window, UTC."""

    #: `day` or `month`.
    window: str
    #: Prompt and completion tokens together; None: not counted in tokens.
    tokens: int | None = None
    #: Spend (the models' `prices` per million tokens); None: not counted in spend.
    spend: float | None = None
    #: The hour (UTC) a day window starts at, and a month window on its `start_day`.
    start_hour: int = 0
    #: The day of the month a month window starts on (1-28).
    start_day: int = 1
    #: The first hex digits of a key's SHA-256 (`key_id`): the budget of that key alone;
    #: None: the team's.
    key: str | None = None


@dataclass(frozen=True)
class AliasConfig:
    """A model name that stands for others: `(model, weight)` targets, drawn by weight."""

    name: str
    targets: tuple[tuple[str, float], ...]


@dataclass(frozen=True)
class QueueConfig:
    """A bounded wait for a slot (`queue:`, top level or per model)."""

    #: Seconds a request may wait for a slot; one that cannot have it by then gets 503.
    max_wait: float
    #: Requests that may wait at once, per model; one more gets 503 at once.
    max_depth: int = 1024
    #: Seconds after which a waiter of any priority is served next.
    max_starvation: float = 10.0


@dataclass(frozen=True)
class TeamConfig:
    """A product team: its share of the slots, its limits (None: none), its models."""

    name: str
    #: Its weight in the fair share of `max_concurrent_requests` when slots are scarce.
    weight: float = 1.0
    max_concurrent_requests: int | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    #: The models its keys may use and see; empty: every model.
    models: tuple[str, ...] = ()
    #: Its requests' priority in the queue (higher first); `x-furnace-priority` may lower it.
    priority: int = 0
    #: Its budgets over calendar windows (gateway.teams.budgets).
    budgets: tuple[BudgetConfig, ...] = ()
    #: Aliases of its own, over the top-level ones of the same name.
    aliases: tuple[AliasConfig, ...] = ()


@dataclass(frozen=True)
class KeyConfig:
    """An API key, known by the SHA-256 of its exact text (never the key), and its team."""

    sha256: bytes
    team: str


@dataclass(frozen=True)
class WorkerTLS:
    """TLS on the gateway's gRPC channels to workers; mutual with a client certificate."""

    #: PEM roots that sign the workers' certificates; None: the system's roots.
    ca_file: str | None = None
    #: The gateway's client certificate and key (PEM), for workers that ask for one.
    cert_file: str | None = None
    key_file: str | None = None
    #: The name the workers' certificates hold, when it is not their address's host.
    server_name: str | None = None


@dataclass(frozen=True)
class Config:
    """Everything `furnace-gateway serve` reads. Each field is declared once, here: its
    type, default, bounds and meaning (`setting`)."""

    host: str = setting("0.0.0.0", "the address the gateway listens on")
    port: int = setting(8000, "the port the gateway listens on", minimum=0, maximum=65535)
    admin_port: int | None = setting(
        None,
        "the port of the admin listener (`/metrics`, `/metrics/json`, `/admin/workers`, and the "
        "probes), as Envoy's admin port; none: no admin listener, and a keyed gateway serves "
        "those routes nowhere",
        minimum=0,
        maximum=65535,
    )
    admin_host: str | None = setting(
        None, "the address the admin listener listens on; none: the same as `host`"
    )
    allowed_hosts: tuple[str, ...] = setting(
        (),
        "host names the `Host` header may hold (others get 421; probes and metrics exempt); "
        "none: any, but only loopback names when `host` is a loopback address",
    )
    max_concurrent_requests: int = setting(
        256, "requests served at once, all routes together; one more gets 503 at once", minimum=1
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
        "logprobs); more is a 400 naming `max_tokens` (without `max_tokens`, the most that "
        "fits is its `max_tokens` where the model's context could pass it)",
        minimum=1,
    )
    max_body_bytes: int = setting(
        4 * 1024 * 1024,
        "the largest request body, in bytes; a larger one gets 413 before it is read",
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
    )
    teams: tuple[TeamConfig, ...] = setting(
        (), "product teams by name: their share of the slots, their limits, their models"
    )
    redis_url: str | None = setting(
        None,
        "Redis (`redis://`, `rediss://`, `unix://`) holding the teams' limits for every "
        "replica; none: each gateway's memory",
    )
    redis_timeout: float = setting(
        0.25,
        "seconds for each Redis call; past it the gateway serves with its local limits",
        minimum=0.001,
    )
    redis_key_prefix: str = setting(
        "furnace",
        "prefix of the Redis keys, so gateways of several deployments can share a Redis",
        min_length=1,
    )
    responses_ttl: float = setting(
        2_592_000,  # 30 days, as OpenAI keeps them
        "seconds a stored response (/v1/responses, `store`) is kept, in Redis with "
        "`redis_url`, else in the gateway's memory",
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
_STRUCTURED = ("models", "teams", "keys", "worker_tls", "allowed_hosts", "queue", "aliases")


def _number(name: str, value: Any, kind: type, minimum: float, maximum: float | None = None) -> Any:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ConfigError(f"{name}: expected a number, got {value!r}")
    try:
        number = kind(value)
    except ValueError:
        raise ConfigError(f"{name}: expected a number, got {value!r}") from None
    if kind is int and isinstance(value, float) and value != number:
        raise ConfigError(f"{name}: expected a whole number, got {value!r}")
    if number < minimum:
        raise ConfigError(f"{name}: must be at least {minimum}, got {value!r}")
    if maximum is not None and number > maximum:
        raise ConfigError(f"{name}: must be at most {maximum}, got {value!r}")
    return number


def _text(name: str, value: Any, spec: Spec) -> str:
    if spec.choices:
        text = str(value).lower()
        if text not in spec.choices:
            raise ConfigError(f"{name}: expected one of {', '.join(spec.choices)}")
        return text
    if not isinstance(value, str) or len(value) < spec.min_length:
        wanted = "a non-empty string" if spec.min_length else "a string"
        raise ConfigError(f"{name}: expected {wanted}")
    return value


def _scalars(values: dict[str, Any]) -> None:
    """Checks, in place, the top-level numbers, strings and flags against their `Spec`."""
    for name, spec in SPECS.items():
        if name in values and TYPES[name] in (int, float):
            minimum = 0 if spec.minimum is None else spec.minimum
            values[name] = _number(name, values[name], TYPES[name], minimum, spec.maximum)
    for name, spec in SPECS.items():
        if name in values and TYPES[name] is str:
            values[name] = _text(name, values[name], spec)
        elif name in values and TYPES[name] is bool:
            values[name] = _flag(name, values[name])


def _host_names(raw: Any) -> tuple[str, ...]:
    """`allowed_hosts`: a list of names (or one string of comma-separated names)."""
    if isinstance(raw, str):
        raw = raw.split(",")
    if raw is None:
        return ()
    if not isinstance(raw, list | tuple) or not all(isinstance(h, str) and h.strip() for h in raw):
        raise ConfigError("allowed_hosts: expected a list of host names")
    return tuple(h.strip().strip("[]").rstrip(".").lower() for h in raw)


def _flag(name: str, value: Any) -> bool:
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    if not isinstance(value, bool):
        raise ConfigError(f"{name}: expected true or false, got {value!r}")
    return value


def _tokenizer_dir(where: str, value: Any, upstream: str) -> str | None:
    """`tokenizer`: required with `vllm-grpc`, a directory whose tokenizer files can be read."""
    if value is None:
        if upstream == "vllm-grpc":
            raise ConfigError(f"{where}.tokenizer: required with upstream: vllm-grpc")
        return None
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}.tokenizer: expected a directory")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if not os.access(Path(value, name), os.R_OK):
            raise ConfigError(f"{where}.tokenizer: cannot read {name} in {value}")
    return value


def _queue(where: str, raw: Any, base: QueueConfig | None) -> QueueConfig | None:
    """`queue`: a mapping of `max_wait`, `max_depth`, `max_starvation` over `base`."""
    if raw is None:
        return base
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: expected a mapping (max_wait, max_depth, max_starvation)")
    unknown = set(raw) - {f.name for f in fields(QueueConfig)}
    if unknown:
        raise ConfigError(f"{where}.{sorted(unknown)[0]}: unknown field")
    if base is None and "max_wait" not in raw:
        raise ConfigError(f"{where}.max_wait: required")
    values = {} if base is None else {f.name: getattr(base, f.name) for f in fields(QueueConfig)}
    for name, kind, minimum in (
        ("max_wait", float, 0.001),
        ("max_depth", int, 1),
        ("max_starvation", float, 0.001),
    ):
        if name in raw:
            values[name] = _number(f"{where}.{name}", raw[name], kind, minimum)
    return QueueConfig(**values)


def _model(where: str, raw: Any, queue: QueueConfig | None = None) -> ModelConfig:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: expected a mapping with a name")
    unknown = set(raw) - {f.name for f in fields(ModelConfig)}
    if unknown:
        raise ConfigError(f"{where}.{sorted(unknown)[0]}: unknown field")
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}.name: expected a non-empty string")
    kind = raw.get("kind", "llm")
    if kind not in MODEL_KINDS:
        raise ConfigError(f"{where}.kind: expected one of {', '.join(MODEL_KINDS)}, got {kind!r}")
    workers = raw.get("workers", [])
    if not isinstance(workers, list) or not all(isinstance(w, str) and w for w in workers):
        raise ConfigError(f"{where}.workers: expected a list of addresses")
    if kind == "llm" and not workers:
        raise ConfigError(f"{where}.workers: an llm model needs at least one worker")
    max_len = raw.get("max_model_len")
    if max_len is not None:
        max_len = _number(f"{where}.max_model_len", max_len, int, 1)
    max_tokens_limit = raw.get("max_tokens_limit")
    if max_tokens_limit is not None:
        max_tokens_limit = _number(f"{where}.max_tokens_limit", max_tokens_limit, int, 1)
    upstream = raw.get("upstream", "kserve-grpc" if kind == "tensor" else "grpc")
    if upstream not in UPSTREAMS:
        raise ConfigError(f"{where}.upstream: expected one of {', '.join(UPSTREAMS)}")
    if (kind == "tensor") != (upstream == "kserve-grpc"):
        raise ConfigError(f"{where}.upstream: kserve-grpc is for kind: tensor models, and only it")
    tokenizer = _tokenizer_dir(where, raw.get("tokenizer"), upstream)
    tool_call_parser = raw.get("tool_call_parser")
    if tool_call_parser is not None and (
        upstream != "vllm-grpc" or tool_call_parser not in TOOL_CALL_PARSERS
    ):
        raise ConfigError(
            f"{where}.tool_call_parser: with upstream: vllm-grpc, one of "
            f"{', '.join(TOOL_CALL_PARSERS)}"
        )
    for i, entry in enumerate(workers):
        is_url = entry.startswith(("http://", "https://"))
        if is_url != (upstream == "openai"):
            expected = "an http(s):// base URL" if upstream == "openai" else "host:port or dns:"
            raise ConfigError(f"{where}.workers[{i}]: expected {expected}, got {entry!r}")
    balance = raw.get("balance", "least_outstanding")
    if balance not in BALANCE_POLICIES:
        raise ConfigError(
            f"{where}.balance: expected one of {', '.join(BALANCE_POLICIES)}, got {balance!r}"
        )
    weights = raw.get("weights") or {}
    if not isinstance(weights, Mapping):
        raise ConfigError(f"{where}.weights: expected a mapping of worker to weight")
    for entry, weight in weights.items():
        if entry not in workers:
            raise ConfigError(f"{where}.weights.{entry}: not one of the model's workers")
        _number(f"{where}.weights.{entry}", weight, float, 0.001)
    api_key_env, ca_file = _upstream_credentials(where, raw, upstream)
    plain_text_contents = raw.get("plain_text_contents", True)
    if not isinstance(plain_text_contents, bool):
        raise ConfigError(f"{where}.plain_text_contents: expected true or false")
    return ModelConfig(
        name=name,
        kind=kind,
        workers=tuple(workers),
        max_model_len=max_len,
        balance=balance,
        upstream=upstream,
        tokenizer=tokenizer,
        tool_call_parser=tool_call_parser,
        plain_text_contents=plain_text_contents,
        weights=tuple((entry, float(weight)) for entry, weight in weights.items()),
        max_tokens_limit=max_tokens_limit,
        queue=_queue(f"{where}.queue", raw.get("queue"), queue),
        api_key_env=api_key_env,
        ca_file=ca_file,
        fallbacks=_names(f"{where}.fallbacks", raw.get("fallbacks")),
        prices=_prices(f"{where}.prices", raw.get("prices")),
        routing=_routing_policy(f"{where}.routing", raw.get("routing")),
    )


def _routing_policy(where: str, raw: Any) -> RoutingConfig | None:
    """`routing: {policy, weights...}` (`RoutingConfig`), each number checked."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: expected a mapping (policy, weights)")
    unknown = set(raw) - {f.name for f in fields(RoutingConfig)}
    if unknown:
        raise ConfigError(f"{where}.{sorted(unknown)[0]}: unknown field")
    values: dict[str, Any] = {}
    policy = raw.get("policy", "kv_aware")
    if policy not in ROUTING_POLICIES:
        raise ConfigError(f"{where}.policy: expected one of {', '.join(ROUTING_POLICIES)}")
    values["policy"] = policy
    for declared in fields(RoutingConfig):
        name = declared.name
        if name in raw and name != "policy":
            kind = int if name.startswith("max_") else float
            minimum = 1 if kind is int or name == "session_load_factor" else 0
            number = _number(f"{where}.{name}", raw[name], kind, minimum, 10_000_000)
            if number != number:  # NaN passes both bounds
                raise ConfigError(f"{where}.{name}: expected a number, got {raw[name]!r}")
            values[name] = number
    return RoutingConfig(**values)


def _names(where: str, raw: Any) -> tuple[str, ...]:
    """A list of model names (checked against the models later, in `_routing`)."""
    if raw is None:
        return ()
    if not isinstance(raw, list) or not all(isinstance(n, str) and n for n in raw):
        raise ConfigError(f"{where}: expected a list of model names")
    return tuple(raw)


def _prices(where: str, raw: Any) -> tuple[float, float] | None:
    """`prices: {prompt, completion}`: spend per million tokens, neither negative."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping) or not raw or set(raw) - {"prompt", "completion"}:
        raise ConfigError(f"{where}: expected a mapping of prompt and completion prices")
    prompt, completion = (
        _number(f"{where}.{k}", raw.get(k, 0), float, 0) for k in ("prompt", "completion")
    )
    return (prompt, completion)


def _budget(where: str, raw: Any) -> BudgetConfig:
    """One `budgets[]` entry: a window and `tokens` and/or `spend`."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: expected a mapping with window and tokens or spend")
    unknown = set(raw) - {f.name for f in fields(BudgetConfig)}
    if unknown:
        raise ConfigError(f"{where}.{sorted(unknown)[0]}: unknown field")
    window = raw.get("window")
    if window not in BUDGET_WINDOWS:
        raise ConfigError(f"{where}.window: expected one of {', '.join(BUDGET_WINDOWS)}")
    if raw.get("tokens") is None and raw.get("spend") is None:
        raise ConfigError(f"{where}.tokens: a budget needs tokens or spend")
    key = raw.get("key")
    if key is not None and (not isinstance(key, str) or not re.fullmatch(r"[0-9a-f]{8,64}", key)):
        raise ConfigError(f"{where}.key: expected a key id (8 or more lowercase hex digits)")
    optional = {
        name: _number(f"{where}.{name}", raw[name], kind, 0)
        for name, kind in (("tokens", int), ("spend", float))
        if raw.get(name) is not None
    }
    return BudgetConfig(
        window,
        start_hour=_number(f"{where}.start_hour", raw.get("start_hour", 0), int, 0, 23),
        start_day=_number(f"{where}.start_day", raw.get("start_day", 1), int, 1, 28),
        key=key,
        **optional,
    )


def _aliases(where: str, raw: Any) -> tuple[AliasConfig, ...]:
    """`aliases: {name: [{model, weight}]}`; the names are checked in `_routing`."""
    if raw is None:
        return ()
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: expected a mapping of alias to [{{model, weight}}]")
    aliases = []
    for name, targets in raw.items():
        at = f"{where}.{name}"
        if not isinstance(targets, list) or not targets:
            raise ConfigError(f"{at}: expected a list of {{model, weight}}")
        parsed = []
        for i, target in enumerate(targets):
            if not isinstance(target, Mapping) or set(target) - {"model", "weight"}:
                raise ConfigError(f"{at}[{i}]: expected a mapping of model and weight")
            model = target.get("model")
            if not isinstance(model, str) or not model:
                raise ConfigError(f"{at}[{i}].model: expected a model name")
            parsed.append((model, _number(f"{at}[{i}].weight", target.get("weight", 1), float, 0)))
        if sum(weight for _, weight in parsed) <= 0:
            raise ConfigError(f"{at}: the weights sum to 0")
        aliases.append(AliasConfig(str(name), tuple(parsed)))
    return tuple(aliases)


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
            _no_cycle(f"{where}.{name}", name, known, ())
    for i, model in enumerate(values["models"]):
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


def _upstream_credentials(where: str, raw: Mapping[str, Any], upstream: str) -> tuple[Any, Any]:
    """`api_key_env` names a variable that is set; `ca_file` is readable; both for `openai`."""
    api_key_env, ca_file = raw.get("api_key_env"), raw.get("ca_file")
    for name, value in (("api_key_env", api_key_env), ("ca_file", ca_file)):
        if value is None:
            continue
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{where}.{name}: expected a non-empty string")
        if upstream != "openai":
            raise ConfigError(f"{where}.{name}: only for `upstream: openai`")
    if api_key_env is not None and not os.environ.get(api_key_env):
        raise ConfigError(f"{where}.api_key_env: the environment variable {api_key_env} is not set")
    if ca_file is not None:
        try:
            Path(ca_file).read_bytes()
        except OSError as error:
            raise ConfigError(f"{where}.ca_file: cannot read {ca_file}: {error.strerror}") from None
    return api_key_env, ca_file


def _team(name: Any, raw: Any, models: set[str]) -> TeamConfig:
    if not isinstance(name, str) or not TEAM_NAME.fullmatch(name):
        raise ConfigError(f"teams.{name}: a team name is letters, digits, '_', '.', '-'")
    where = f"teams.{name}"
    raw = {} if raw is None else raw
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: expected a mapping of settings")
    unknown = set(raw) - ({f.name for f in fields(TeamConfig)} - {"name"})
    if unknown:
        raise ConfigError(f"{where}.{sorted(unknown)[0]}: unknown field")
    limits = {
        key: _number(f"{where}.{key}", raw[key], int, 1)
        for key in ("max_concurrent_requests", "requests_per_minute", "tokens_per_minute")
        if raw.get(key) is not None
    }
    allowed = raw.get("models") or []
    if not isinstance(allowed, list):
        raise ConfigError(f"{where}.models: expected a list of model names")
    for i, model in enumerate(allowed):
        if model not in models:
            raise ConfigError(f"{where}.models[{i}]: {model!r} is not a configured model")
    weight = _number(f"{where}.weight", raw.get("weight", 1.0), float, 0.001)
    priority = _number(f"{where}.priority", raw.get("priority", 0), int, -1000, 1000)
    budgets = raw.get("budgets") or []
    if not isinstance(budgets, list):
        raise ConfigError(f"{where}.budgets: expected a list of {{window, tokens}}")
    return TeamConfig(
        name,
        weight,
        models=tuple(allowed),
        priority=priority,
        budgets=tuple(_budget(f"{where}.budgets[{i}]", b) for i, b in enumerate(budgets)),
        aliases=_aliases(f"{where}.aliases", raw.get("aliases")),
        **limits,
    )


def parse_keys(where: str, raw: Any, teams: set[str]) -> tuple[KeyConfig, ...]:
    """Checked key entries (`[{sha256, team}]`); `where` names the field in errors.
    Errors never repeat a value: a key pasted where its hash belongs stays out of logs."""
    if not isinstance(raw, list):
        raise ConfigError(f"{where}: expected a list of {{sha256, team}} entries")
    keys: list[KeyConfig] = []
    for i, entry in enumerate(raw):
        at = f"{where}[{i}]"
        if not isinstance(entry, Mapping):
            raise ConfigError(f"{at}: expected a mapping with sha256 and team")
        unknown = set(entry) - {"sha256", "team"}
        if unknown:
            raise ConfigError(f"{at}.{sorted(unknown)[0]}: unknown field")
        digest = entry.get("sha256")
        if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-fA-F]{64}", digest):
            raise ConfigError(f"{at}.sha256: expected the 64 hex digits of the key's SHA-256")
        team = entry.get("team")
        if team not in teams:
            raise ConfigError(f"{at}.team: not one of the teams listed in `teams`")
        key = KeyConfig(bytes.fromhex(digest), team)
        if any(k.sha256 == key.sha256 for k in keys):
            raise ConfigError(f"{at}.sha256: the same key is listed twice")
        keys.append(key)
    return tuple(keys)


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


def _optional_text(name: str, value: Any) -> str | None:
    if value is not None and (not isinstance(value, str) or not value):
        raise ConfigError(f"{name}: expected a non-empty string")
    return value


def _worker_tls(raw: Any) -> WorkerTLS | None:
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ConfigError("worker_tls: expected a mapping (ca_file, cert_file, key_file)")
    unknown = set(raw) - {f.name for f in fields(WorkerTLS)}
    if unknown:
        raise ConfigError(f"worker_tls.{sorted(unknown)[0]}: unknown field")
    tls = WorkerTLS(**{k: _optional_text(f"worker_tls.{k}", v) for k, v in raw.items()})
    if (tls.cert_file is None) != (tls.key_file is None):
        raise ConfigError("worker_tls.key_file: cert_file and key_file go together")
    for name in ("ca_file", "cert_file", "key_file"):
        path = getattr(tls, name)
        if path is not None and not os.access(path, os.R_OK):
            raise ConfigError(f"worker_tls.{name}: cannot read {path}")
    return tls


def _teams_and_keys(values: dict[str, Any]) -> None:
    """Checks `teams`, `keys`, `keys_file`, `redis_url` and `worker_tls` in place."""
    teams = values.get("teams") or {}
    if not isinstance(teams, Mapping):
        raise ConfigError("teams: expected a mapping of team name to its settings")
    models = {m.name for m in values["models"]}
    values["teams"] = tuple(_team(name, raw, models) for name, raw in teams.items())
    names = set(teams)
    values["keys"] = parse_keys("keys", values.get("keys") or [], names)
    keys_file = values["keys_file"] = _optional_text("keys_file", values.get("keys_file"))
    if keys_file is not None:
        merge_keys(values["keys"], load_keys_file(keys_file, names))
    url = values["redis_url"] = _optional_text("redis_url", values.get("redis_url"))
    # never echo the URL: it may hold a password
    if url is not None and not url.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigError("redis_url: expected a redis://, rediss:// or unix:// URL")
    values["worker_tls"] = _worker_tls(values.get("worker_tls"))


def _admin_listener(values: dict[str, Any]) -> None:
    """Checks `admin_port` (none, or a port other than `port`) and `admin_host` in place."""
    admin_port = values.get("admin_port")
    if admin_port is not None:
        admin_port = values["admin_port"] = _number("admin_port", admin_port, int, 0, 65535)
        if admin_port != 0 and admin_port == values.get("port", Config.port):
            raise ConfigError("admin_port: must differ from port")
    values["admin_host"] = _optional_text("admin_host", values.get("admin_host"))


def parse_config(raw: Mapping[str, Any], env: Mapping[str, str] | None = None) -> Config:
    """Builds a checked `Config` from a YAML mapping and environment overrides."""
    env = os.environ if env is None else env
    if not isinstance(raw, Mapping):
        raise ConfigError("config: expected a mapping at the top level")
    values = dict(raw)
    known = {f.name for f in fields(Config)}
    for name in known:
        override = env.get(ENV_PREFIX + name.upper())
        if override is not None:
            values[name] = yaml.safe_load(override) if name in _STRUCTURED else override
    unknown = set(values) - known
    if unknown:
        raise ConfigError(f"{sorted(unknown)[0]}: unknown field")
    _scalars(values)
    _admin_listener(values)
    values["allowed_hosts"] = _host_names(values.get("allowed_hosts"))
    models = values.get("models") or []
    if not isinstance(models, list):
        raise ConfigError("models: expected a list")
    queue = values["queue"] = _queue("queue", values.get("queue"), None)
    values["models"] = tuple(_model(f"models[{i}]", m, queue) for i, m in enumerate(models))
    names = [m.name for m in values["models"]]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ConfigError(f"models[{i}].name: {name!r} is listed twice")
    _teams_and_keys(values)
    values["aliases"] = _aliases("aliases", values.get("aliases"))
    _routing(values)
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
