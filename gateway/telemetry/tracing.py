"""OpenTelemetry spans for a request and its engine call, when turned on.

Off by default, and then free: no OpenTelemetry import, and every hook is a
check of one boolean that hands back a no-op context manager (not a
`@contextmanager` generator, which costs a microsecond or two a request for
nothing). With `tracing: true` (and the `otel` extra installed) the gateway
continues the client's W3C trace, records a SERVER span for the
request and a CLIENT span for the worker call, and sends the worker that
span's `traceparent`; a CLIENT span too for each step with a remote MCP server a
request lets the model call (`execute_tool {name}`, `mcp tools/list`). A generation's
request span ends with OpenTelemetry's GenAI usage attributes:
`gen_ai.usage.input_tokens` (the prompt), `gen_ai.usage.output_tokens` and, of the
input, the tokens the engine's prefix cache held,
`gen_ai.usage.cache_read.input_tokens` (0 where the engine says none, or does not
say). Spans go to the tracer provider the process has; if it has none, to an
OTLP exporter configured by the standard OTEL_* variables.
Without tracing, a client's `traceparent` is still passed to the worker as is.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

log = logging.getLogger("furnace.tracing")
#: What a request's span is with tracing off: nothing, and nothing to build.
_NO_SPAN: AbstractContextManager[Any] = nullcontext(None)


class Tracing:
    """The gateway's tracer, or nothing."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._tracer: Any = None
        if enabled:
            self._tracer = _tracer()

    def request(self, name: str, traceparent: str | None) -> AbstractContextManager[Any]:
        """A SERVER span for one request, child of the client's trace if any."""
        if not self.enabled:
            return _NO_SPAN
        return self._request(name, traceparent)

    def engine_call(
        self,
        model: str,
        metadata: tuple[tuple[str, str], ...],
        name: str = "furnace.engine/Generate",
    ) -> AbstractContextManager[tuple[Any, tuple[tuple[str, str], ...]]]:
        """A CLIENT span `name` (the gRPC method) for the worker call; yields it and the
        metadata that carries it to the worker."""
        if not self.enabled:
            return nullcontext((None, metadata))
        return self._engine_call(model, metadata, name)

    def tool_step(self, step: str, server: str, name: str = "") -> AbstractContextManager[Any]:
        """A CLIENT span for one step with a remote MCP server (`list` its tools, or
        `call` the tool `name`), as OpenTelemetry's GenAI conventions name a tool's run
        (`execute_tool {name}`); `server` is the allowed prefix its URL is under."""
        if not self.enabled:
            return _NO_SPAN
        from opentelemetry.trace import SpanKind

        attributes = {"furnace.mcp.server": server, "furnace.mcp.step": step}
        if step == "call":
            attributes |= {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": name}
        title = f"execute_tool {name}" if step == "call" else "mcp tools/list"
        span: AbstractContextManager[Any] = self._tracer.start_as_current_span(
            title, kind=SpanKind.CLIENT, attributes=attributes
        )
        return span

    @contextmanager
    def _request(self, name: str, traceparent: str | None) -> Iterator[Any]:
        from opentelemetry.propagate import extract
        from opentelemetry.trace import SpanKind

        parent = extract({"traceparent": traceparent}) if traceparent else None
        with self._tracer.start_as_current_span(name, context=parent, kind=SpanKind.SERVER) as span:
            yield span

    @contextmanager
    def _engine_call(
        self, model: str, metadata: tuple[tuple[str, str], ...], name: str
    ) -> Iterator[tuple[Any, tuple[tuple[str, str], ...]]]:
        from opentelemetry.propagate import inject
        from opentelemetry.trace import SpanKind

        with self._tracer.start_as_current_span(
            name,
            kind=SpanKind.CLIENT,
            attributes={"gen_ai.request.model": model},
        ) as span:
            carrier: dict[str, str] = {}
            inject(carrier)
            passed = tuple((k, v) for k, v in metadata if k != "traceparent")
            yield span, passed + tuple(carrier.items())


def annotate(span: Any, attributes: dict[str, Any]) -> None:
    """Sets a span's attributes at its end (no-op without a span)."""
    if span is not None:
        span.set_attributes({k: v for k, v in attributes.items() if v is not None})


def _tracer() -> Any:
    try:
        from opentelemetry import trace
    except ImportError as error:
        raise RuntimeError(
            "tracing is on but OpenTelemetry is not installed: pip install 'furnace-gateway[otel]'"
        ) from error
    provider = trace.get_tracer_provider()
    if type(provider).__name__ in ("ProxyTracerProvider", "NoOpTracerProvider"):
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        provider = TracerProvider(resource=Resource.create({"service.name": "furnace-gateway"}))
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        trace.set_tracer_provider(provider)
        log.info("tracing to OTLP (OTEL_EXPORTER_OTLP_* settings)")
    return trace.get_tracer("furnace-gateway")
