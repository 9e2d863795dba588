"""A vLLM gRPC server's own data-parallel ranks, against the engine stand-in of
`benchmarks/fake_vllm_grpc.py` served by grpc.aio on loopback: `GetServerInfo` gives the
whole group's size, `GetLoads` an entry for each rank the server runs. Under vLLM's hybrid
load balancing a server runs a slice of the ranks (here 8 and 9 of 16): given two
engines, neither of its ranks 0 and 1 is one it runs, so both are kept out
(`no_such_engine`), the log naming its ranks. Under external load balancing a server runs
one rank (here 5) and is one worker: nothing to say about its engines, and it serves.
A server of the whole group (internal load balancing) lists only the ranks that have
stepped: its idle second engine serves all the same. After each test nothing is left in
the gateway."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from tokenizers import Tokenizer

from benchmarks.fake_vllm_grpc import TEXT, FakeVllm, start
from gateway.config import ModelConfig
from tests.support.servers import Gateway, ServerLoop, worker_states
from tests.support.vllm import build_vllm_model
from tests.support.waiting import HANG_GUARD, wait_until

#: Each server: the ranks its GetLoads lists, and its group's size (GetServerInfo's).
SERVERS = {"hybrid": ((8, 9), 16), "external": ((5,), 16), "internal": ((0,), 2)}


class Ranked(FakeVllm):
    """The stand-in, one server of a data-parallel group of `group` listing `ranks`."""

    def __init__(self, model_dir: Path, name: str, ranks: tuple[int, ...], group: int) -> None:
        tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
        super().__init__(ids, [], 0.0, 1, (str(model_dir), name))
        self.ranks, self.group = ranks, group

    async def GetServerInfo(self, request: object, context: object) -> pb.GetServerInfoResponse:
        return pb.GetServerInfoResponse(data_parallel_size=self.group)

    async def GetLoads(self, request: object, context: object) -> pb.GetLoadsResponse:
        loads = [pb.SchedulerLoad(dp_rank=rank) for rank in self.ranks]
        return pb.GetLoadsResponse(dp_rank_count=len(loads), loads=loads)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_vllm_model(tmp_path_factory.mktemp("ranks") / "model")


@pytest.fixture
def servers(server_loop: ServerLoop, model_dir: Path) -> Iterator[dict[str, str]]:
    """`SERVERS`, by the model each serves: their addresses."""
    started: list[grpc.aio.Server] = []
    addresses = {}

    for name, (ranks, group) in SERVERS.items():
        server, port = server_loop.call(start(Ranked(model_dir, name, ranks, group)))
        started.append(server)
        addresses[name] = f"127.0.0.1:{port}"
    yield addresses
    for server in started:
        server_loop.call(server.stop(None))


def test_a_servers_engines_are_the_ranks_it_runs_not_its_groups_size(
    servers: dict[str, str],
    gateway_with: Callable[..., Gateway],
    model_dir: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    def model(name: str, size: int) -> ModelConfig:
        return ModelConfig(
            name,
            upstream="vllm-grpc",
            tokenizer=str(model_dir),
            workers=(servers[name],),
            data_parallel_size=size,
        )

    gw = gateway_with(models=(model("hybrid", 2), model("external", 1), model("internal", 2)))
    hybrid = servers["hybrid"]
    out = dict.fromkeys((f"{hybrid}#dp0", f"{hybrid}#dp1"), "no_such_engine")
    wait_until(lambda: worker_states(gw, "hybrid") == out, "the ranks it does not run kept out")
    said = " ".join(r.getMessage() for r in caplog.records if r.name == "furnace.fleet")
    assert "its server runs 2 data-parallel engines (ranks 8, 9), not 2" in said
    external = servers["external"]
    wait_until(lambda: worker_states(gw, "external") == {external: "healthy"}, "it serves")
    internal = servers["internal"]
    engines = dict.fromkeys((f"{internal}#dp0", f"{internal}#dp1"), "healthy")
    wait_until(lambda: worker_states(gw, "internal") == engines, "both engines serve")
    for name in ("external", "internal"):
        body = {"model": name, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
        answer = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=HANG_GUARD)
        assert answer.status_code == 200, answer.text
        assert not [r for r in caplog.records if servers[name] in r.getMessage()]
