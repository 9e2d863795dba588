"""Prefill/decode disaggregation's handoff, as vLLM's NixlConnector speaks it over both its
servers (the OpenAI server's `kv_transfer_params`, the gRPC server's
`kv_transfer_params_json`): what a prefill asks, and what its answer gives the decode
worker, which the gateway passes on as it came."""

from __future__ import annotations

from typing import Any

import orjson

from gateway.protocol import errors

#: What a prefill asks of the connector: keep the prompt's KV blocks for a decode worker to
#: pull (vLLM's own proxy sends the same).
PREFILL_TRANSFER: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
PREFILL_TRANSFER_JSON = orjson.dumps(PREFILL_TRANSFER).decode()


def kv_transfer_text(params: Any) -> str:
    """Where a prefill worker says it keeps the blocks, as the decode worker is sent it (a
    JSON object's text), or a `Failed` naming what is missing (a server whose vLLM runs
    no KV connector answers without)."""
    if not isinstance(params, dict) or not params:
        raise errors.Failed(
            "The prefill worker answered without kv_transfer_params (is its vLLM started "
            "with a --kv-transfer-config?)."
        )
    return orjson.dumps(params).decode()
