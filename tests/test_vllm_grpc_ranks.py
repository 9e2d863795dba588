"""A vLLM gRPC server's own data-parallel ranks, against the engine stand-in of
`benchmarks/fake_vllm_grpc.py` served by grpc.aio on loopback: `GetServerInfo` gives the
whole group's size, `GetLoads` an entry for each rank the server runs. Under vLLM's hybrid
load balancing a server runs a slice of the ranks (here 8 and 9 of 16): its two engines
are pinned by their index among its own (`data_parallel_rank` 0 and 1, as vLLM pins) and
read by their ranks (the loads of ranks 8 and 9); a third is one it does not run, kept
out (`no_such_engine`), the log naming its ranks. Under external load balancing a server
runs one rank (here 5) and is one worker: nothing to say about its engines, and it serves.
A server of the whole group (internal load balancing) lists only the ranks that have
stepped: its idle second engine serves all the same. After each test nothing is left in
the gateway."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
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
        self.address = ""  # where it listens, once it does
        #: The engine each request was pinned to (None: not pinned), in order.
        self.pinned: list[int | None] = []

    async def Generate(
        self, request: pb.GenerateRequest, context: object
    ) -> AsyncIterator[pb.GenerateResponse]:
        pinned = request.HasField("data_parallel_rank")
        self.pinned.append(request.data_parallel_rank if pinned else None)
        async for response in super().Generate(request, context):
            yield response

    async def GetServerInfo(self, request: object, context: object) -> pb.GetServerInfoResponse:
        return pb.GetServerInfoResponse(data_parallel_size=self.group)

    async def GetLoads(self, request: object, context: object) -> pb.GetLoadsResponse:
        # each rank running as many requests as its rank is past the first's
        first = self.ranks[0]
        loads = [pb.SchedulerLoad(dp_rank=r, num_running_reqs=r - first) for r in self.ranks]
        return pb.GetLoadsResponse(dp_rank_count=len(loads), loads=loads)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_vllm_model(tmp_path_factory.mktemp("ranks") / "model")


@pytest.fixture
def servers(server_loop: ServerLoop, model_dir: Path) -> Iterator[dict[str, Ranked]]:
    """`SERVERS`, by the model each serves, at `address`."""
    started: list[grpc.aio.Server] = []
    engines = {}

    for name, (ranks, group) in SERVERS.items():
        engine = engines[name] = Ranked(model_dir, name, ranks, group)
        server, port = server_loop.call(start(engine))
        engine.address = f"127.0.0.1:{port}"
        started.append(server)
    yield engines
    for server in started:
        server_loop.call(server.stop(None))


def test_a_servers_engines_are_the_ranks_it_runs_not_its_groups_size(
    servers: dict[str, Ranked],
    gateway_with: Callable[..., Gateway],
    model_dir: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    def model(name: str, size: int) -> ModelConfig:
        return ModelConfig(
            name,
            upstream="vllm-grpc",
            tokenizer=str(model_dir),
            workers=(servers[name].address,),
            data_parallel_size=size,
        )

    def chat(name: str) -> None:
        body = {"model": name, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
        answer = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=HANG_GUARD)
        assert answer.status_code == 200, answer.text

    gw = gateway_with(models=(model("hybrid", 2), model("external", 1), model("internal", 2)))
    hybrid = servers["hybrid"]
    engines = [f"{hybrid.address}#dp{index}" for index in range(2)]
    wait_until(
        lambda: worker_states(gw, "hybrid") == dict.fromkeys(engines, "healthy"), "both serve"
    )
    pool = gw.state.fleet.models["hybrid"]
    # rank 9 runs one request: the second engine's load, read by its rank
    assert [pool.workers[e].reported_load for e in engines] == [0, 1]
    upstreams = [pool.workers[e].upstream for e in engines]
    assert [(u.data_parallel_rank, u.engine_rank) for u in upstreams] == [(0, 8), (1, 9)]  # type: ignore[attr-defined]
    chat("hybrid")
    assert hybrid.pinned in ([0], [1])  # an index among its own engines, never its rank
    external = servers["external"]
    wait_until(lambda: worker_states(gw, "external") == {external.address: "healthy"}, "serving")
    internal = servers["internal"]
    both = dict.fromkeys((f"{internal.address}#dp0", f"{internal.address}#dp1"), "healthy")
    wait_until(lambda: worker_states(gw, "internal") == both, "both engines serve")
    for name in ("external", "internal"):
        chat(name)
    assert external.pinned == [None]
    assert not [r for r in caplog.records if r.name == "furnace.fleet" and r.levelno >= 30]

    three = gateway_with(models=(model("hybrid", 3),))
    out = {**dict.fromkeys(engines, "healthy"), f"{hybrid.address}#dp2": "no_such_engine"}
    wait_until(lambda: worker_states(three, "hybrid") == out, "the third engine kept out")
    said = " ".join(r.getMessage() for r in caplog.records if r.name == "furnace.fleet")
    assert "its server runs 2 data-parallel engines (ranks 8, 9), not 3" in said
