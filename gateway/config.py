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
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

ENV_PREFIX = "FURNACE_"
MODEL_KINDS = ("llm", "tensor")
BALANCE_POLICIES = ("least_outstanding", "prefix_affinity")
#: Team names go into metric labels and Redis keys: keep them plain.
TEAM_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
UPSTREAMS = ("grpc", "openai")


class ConfigError(ValueError):
    """The config is invalid; the message names the field."""


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
    #: `grpc` (our worker protocol) or `openai`: workers are base URLs
    #: (`http://host:port/v1`) of OpenAI-compatible servers.
    upstream: str = "grpc"
    #: The largest `max_tokens` a request may ask for (also its default); None: no cap.
    max_tokens_limit: int | None = None


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
    """Everything `furnace-gateway serve` reads."""

    host: str = "0.0.0.0"
    port: int = 8000
    #: Requests served at once, all routes together; one more gets 503 at once.
    max_concurrent_requests: int = 256
    #: Seconds for a whole non-streamed answer, and for each event of a stream.
    request_timeout: float = 600.0
    #: Seconds a whole stream may last; its gRPC deadline.
    stream_timeout: float = 3600.0
    #: Seconds of quiet in a stream before an SSE comment keeps proxies from cutting it.
    keepalive_interval: float = 15.0
    #: Largest request body read, in bytes; a larger one gets 413.
    max_body_bytes: int = 4 * 1024 * 1024
    #: Seconds sent in Retry-After with a 503.
    retry_after: int = 1
    log_level: str = "info"
    #: Put prompts in the access log (never completions or keys). Off by default.
    log_prompts: bool = False
    #: OpenTelemetry spans for requests and worker calls (the `otel` extra).
    tracing: bool = False
    #: Seconds after SIGTERM for requests in flight to finish before they are cancelled.
    drain_timeout: float = 30.0
    #: Seconds between DNS lookups of `dns:` worker names.
    discovery_interval: float = 10.0
    #: Seconds between health checks of workers that cannot be watched.
    health_check_interval: float = 5.0
    #: Seconds a worker may take to start an answer before another worker is tried.
    start_timeout: float = 10.0
    #: Consecutive transport failures that eject a worker.
    eject_after_failures: int = 3
    #: Seconds of a first ejection; each further one doubles, up to `eject_max`.
    eject_base: float = 1.0
    eject_max: float = 60.0
    #: Tries per request, the first included; only before the worker's first event.
    retry_attempts: int = 3
    #: Retries allowed, as a fraction of requests over the last 10 seconds.
    retry_budget: float = 0.2
    #: Seconds: the scale of the jittered exponential back-off between tries.
    retry_backoff: float = 0.025
    #: Characters of the prompt that `prefix_affinity` hashes.
    affinity_prefix_chars: int = 256
    #: With `prefix_affinity`, no worker takes more than this times the average load.
    affinity_load_factor: float = 1.25
    #: Most messages in one chat request; more get 400.
    max_messages: int = 2048
    #: Largest total size of a request's headers, in bytes; larger get 431.
    max_header_bytes: int = 32 * 1024
    #: API keys by their SHA-256, each naming its team. No keys (and no
    #: `keys_file`): the gateway is open to anyone who reaches it.
    keys: tuple[KeyConfig, ...] = ()
    #: A YAML file of more keys (a list shaped like `keys`), e.g. from a Kubernetes Secret.
    keys_file: str | None = None
    teams: tuple[TeamConfig, ...] = ()
    #: Redis holding the teams' limits for every replica; None: each gateway's memory.
    redis_url: str | None = None
    #: Seconds for each Redis call; past it the gateway serves with its local limits.
    redis_timeout: float = 0.25
    #: Prefix of the Redis keys, so gateways of several deployments can share a Redis.
    redis_key_prefix: str = "furnace"
    worker_tls: WorkerTLS | None = None
    models: tuple[ModelConfig, ...] = field(default_factory=tuple)


_NUMBERS: dict[str, tuple[type, float]] = {
    "port": (int, 0),
    "max_concurrent_requests": (int, 1),
    "request_timeout": (float, 0.001),
    "stream_timeout": (float, 0.001),
    "keepalive_interval": (float, 0.001),
    "max_body_bytes": (int, 1),
    "retry_after": (int, 0),
    "drain_timeout": (float, 0),
    "discovery_interval": (float, 0.01),
    "health_check_interval": (float, 0.01),
    "start_timeout": (float, 0.001),
    "eject_after_failures": (int, 1),
    "eject_base": (float, 0),
    "eject_max": (float, 0),
    "retry_attempts": (int, 1),
    "retry_budget": (float, 0),
    "retry_backoff": (float, 0),
    "affinity_prefix_chars": (int, 1),
    "affinity_load_factor": (float, 1),
    "max_messages": (int, 1),
    "max_header_bytes": (int, 1024),
    "redis_timeout": (float, 0.001),
}
_LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
#: Fields whose environment override is YAML (a list or a mapping).
_STRUCTURED = ("models", "teams", "keys", "worker_tls")


def _number(name: str, value: Any, kind: type, minimum: float) -> Any:
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
    return number


def _flag(name: str, value: Any) -> bool:
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    if not isinstance(value, bool):
        raise ConfigError(f"{name}: expected true or false, got {value!r}")
    return value


def _model(where: str, raw: Any) -> ModelConfig:
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
    upstream = raw.get("upstream", "grpc")
    if upstream not in UPSTREAMS:
        raise ConfigError(f"{where}.upstream: expected one of {', '.join(UPSTREAMS)}")
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
    return ModelConfig(
        name=name,
        kind=kind,
        workers=tuple(workers),
        max_model_len=max_len,
        balance=balance,
        upstream=upstream,
        weights=tuple((entry, float(weight)) for entry, weight in weights.items()),
        max_tokens_limit=max_tokens_limit,
    )


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
    return TeamConfig(name, weight, models=tuple(allowed), **limits)


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
        raise ConfigError(f"keys_file: cannot read {path}: {error.strerror}") from None
    except yaml.YAMLError:
        raise ConfigError(f"keys_file: {path} is not valid YAML") from None
    if isinstance(raw, Mapping) and set(raw) == {"keys"}:
        raw = raw["keys"]
    return parse_keys("keys_file", raw or [], teams)


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
    """Checks `teams`, `keys`, `keys_file`, `redis_*` and `worker_tls` in place."""
    teams = values.get("teams") or {}
    if not isinstance(teams, Mapping):
        raise ConfigError("teams: expected a mapping of team name to its settings")
    models = {m.name for m in values["models"]}
    values["teams"] = tuple(_team(name, raw, models) for name, raw in teams.items())
    names = set(teams)
    values["keys"] = parse_keys("keys", values.get("keys") or [], names)
    keys_file = values["keys_file"] = _optional_text("keys_file", values.get("keys_file"))
    if keys_file is not None:
        load_keys_file(keys_file, names)
    url = values["redis_url"] = _optional_text("redis_url", values.get("redis_url"))
    # never echo the URL: it may hold a password
    if url is not None and not url.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigError("redis_url: expected a redis://, rediss:// or unix:// URL")
    prefix = _optional_text("redis_key_prefix", values.get("redis_key_prefix", "furnace"))
    values["redis_key_prefix"] = prefix
    values["worker_tls"] = _worker_tls(values.get("worker_tls"))


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
    for name, (kind, minimum) in _NUMBERS.items():
        if name in values:
            values[name] = _number(name, values[name], kind, minimum)
    if not isinstance(values.get("host", ""), str):
        raise ConfigError("host: expected a string")
    for name in ("log_prompts", "tracing"):
        values[name] = _flag(name, values.get(name, False))
    level = str(values.get("log_level", "info")).lower()
    if level not in _LOG_LEVELS:
        raise ConfigError(f"log_level: expected one of {', '.join(_LOG_LEVELS)}")
    values["log_level"] = level
    models = values.get("models") or []
    if not isinstance(models, list):
        raise ConfigError("models: expected a list")
    values["models"] = tuple(_model(f"models[{i}]", m) for i, m in enumerate(models))
    names = [m.name for m in values["models"]]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ConfigError(f"models[{i}].name: {name!r} is listed twice")
    _teams_and_keys(values)
    return Config(**values)


def load_config(path: str | Path, env: Mapping[str, str] | None = None) -> Config:
    """Reads and checks a YAML config file."""
    try:
        raw = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as error:
        raise ConfigError(f"config: cannot read {path}: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"config: {path} is not valid YAML: {error}") from None
    return parse_config(raw, env)
