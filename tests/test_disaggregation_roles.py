"""A split model's vLLM gRPC servers (`upstream: vllm-grpc` with `prefill_workers`) whose
KV connector's role (`GetServerInfo`'s `kv_role`) is the other tier's, against the engine
stand-in of `benchmarks/fake_vllm_grpc.py` served by grpc.aio on loopback, each naming
NixlConnector and a role: a prefill worker that is `kv_consumer`, a decode worker that is
`kv_producer` (a model whose tiers are swapped) are kept out of the rotation, in state
`wrong_kv_role` (`/admin/workers`, `worker_healthy{state}`), logged once with the role and
what the tier needs; servers of the fitting roles, and of `kv_both`, serve either tier. A
server restarted at its address with the fitting role comes back. (Real vLLM servers
without a connector at all: `tests/test_disaggregation_grpc.py`.) After each test nothing
is left in the gateway."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from tokenizers import Tokenizer

from benchmarks.fake_vllm_grpc import TEXT, FakeVllm, start
from gateway.config import ModelConfig
from tests.support.metrics import scrape, value
from tests.support.servers import Gateway, ServerLoop, worker_states
from tests.support.vllm import build_vllm_model
from tests.support.waiting import wait_until

#: The decode worker of one model is the prefill worker of the other, and the other way.
FITS, SWAPPED, BOTH = "tiny-roles-fit", "tiny-roles-swapped", "tiny-roles-both"
ROLES = ("kv_producer", "kv_consumer", "kv_both")


class Roled(FakeVllm):
    """The stand-in, its engine's KV connector of role `role`."""

    def __init__(self, model_dir: Path, role: str) -> None:
        tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
        super().__init__(ids, [], 0.0, 1, (str(model_dir), role))
        self.role = role
        self.address = ""  # where it listens, once it does
        self.server: grpc.aio.Server | None = None

    async def GetServerInfo(self, request: object, context: object) -> pb.GetServerInfoResponse:
        return pb.GetServerInfoResponse(
            kv_connector="NixlConnector", kv_role=self.role, data_parallel_size=1
        )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_vllm_model(tmp_path_factory.mktemp("roles") / "model")


@pytest.fixture
def servers(server_loop: ServerLoop, model_dir: Path) -> Iterator[dict[str, Roled]]:
    """A server of each of `ROLES`, by its role."""
    engines = {}
    for role in ROLES:
        engine = engines[role] = Roled(model_dir, role)
        engine.server, port = server_loop.call(start(engine))
        engine.address = f"127.0.0.1:{port}"
    yield engines
    for engine in engines.values():
        if engine.server is not None:
            server_loop.call(engine.server.stop(None))


def test_a_server_whose_kv_role_is_the_other_tiers_is_kept_out_of_its_tier(
    servers: dict[str, Roled],
    gateway_with: Callable[..., Gateway],
    model_dir: Path,
    server_loop: ServerLoop,
    caplog: pytest.LogCaptureFixture,
) -> None:
    producer, consumer, both = (servers[role] for role in ROLES)

    def model(name: str, decode: Roled, prefill: Roled) -> ModelConfig:
        return ModelConfig(
            name,
            upstream="vllm-grpc",
            tokenizer=str(model_dir),
            workers=(decode.address,),
            prefill_workers=(prefill.address,),
        )

    models = (
        model(FITS, consumer, producer),
        model(SWAPPED, producer, consumer),
        model(BOTH, both, both),
    )
    gw = gateway_with(models=models, health_check_interval=0.1)
    for name in (FITS, BOTH):
        for tier in ("workers", "prefill_workers"):
            wait_until(
                lambda name=name, tier=tier: (
                    set(worker_states(gw, name, tier).values()) == {"healthy"}
                ),
                f"{name}'s {tier} serve",
            )
    kept = {
        "workers": {producer.address: "wrong_kv_role"},
        "prefill_workers": {consumer.address: "wrong_kv_role"},
    }
    for tier, states in kept.items():
        wait_until(
            lambda tier=tier, states=states: worker_states(gw, SWAPPED, tier) == states,
            f"the {tier} of the other tier's role kept out",
        )
    samples = scrape(gw.url)
    healthy = "furnace_gateway_worker_healthy"
    for address in (producer.address, consumer.address):
        labels = {"model": SWAPPED, "worker": address, "state": "wrong_kv_role"}
        assert value(samples, healthy, **labels) == 0
    said = [r.getMessage() for r in caplog.records if r.name == "furnace.fleet"]
    decode_said = [m for m in said if m.startswith(f"decode worker {producer.address}")]
    prefill_said = [m for m in said if m.startswith(f"prefill worker {consumer.address}")]
    assert decode_said == [
        f"decode worker {producer.address} of {SWAPPED} has a KV connector of role "
        "kv_producer (vLLM's --kv-transfer-config kv_role): a decode worker takes KV "
        "blocks, which needs kv_consumer or kv_both: kept out of the rotation"
    ]
    assert prefill_said == [
        f"prefill worker {consumer.address} of {SWAPPED} has a KV connector of role "
        "kv_consumer (vLLM's --kv-transfer-config kv_role): a prefill worker hands KV "
        "blocks on, which needs kv_producer or kv_both: kept out of the rotation"
    ]

    # the prefill server restarted at its address as a producer: seen once it is back
    prefill = gw.state.fleet.models[SWAPPED].prefill
    assert prefill is not None
    worker = prefill.workers[consumer.address]
    assert consumer.server is not None
    server_loop.call(consumer.server.stop(None))
    wait_until(lambda: worker.serving is False, "the prefill server seen gone")
    consumer.role = "kv_producer"
    port = int(consumer.address.rpartition(":")[2])
    consumer.server, _ = server_loop.call(start(consumer, port))
    wait_until(
        lambda: worker_states(gw, SWAPPED, "prefill_workers") == {consumer.address: "healthy"},
        "the restarted prefill server serves",
    )
    assert worker_states(gw, SWAPPED) == {producer.address: "wrong_kv_role"}
