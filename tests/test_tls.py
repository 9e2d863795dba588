"""TLS and mutual TLS between the gateway and its workers, with certificates
made on the spot: what works, and what each side refuses."""

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from gateway.config import ModelConfig, WorkerTLS
from gateway.protocol import errors
from gateway.protocol.tls import ServerTLS, client_credentials
from gateway.upstreams.furnace_grpc import FurnaceGrpcUpstream
from gateway.worker.demo import DemoEngine
from tests.support.certs import CertificateAuthority, Issued
from tests.support.processes import free_port, worker_process
from tests.support.requests import user
from tests.support.waiting import HANG_GUARD, wait_until

MODEL = "tls-demo"


class PKI:
    """Our CA with a worker and a gateway certificate, and a stranger's CA with the same."""

    def __init__(self, folder: Path) -> None:
        self.ca = CertificateAuthority(folder, "furnace-ca")
        self.worker = self.ca.issue("worker", dns=("localhost",), ips=("127.0.0.1",))
        self.named_worker = self.ca.issue("named-worker", dns=("engine.furnace.internal",))
        self.gateway = self.ca.issue("gateway", client=True)
        self.stranger = CertificateAuthority(folder, "stranger-ca")
        self.stranger_worker = self.stranger.issue("stranger-worker", ips=("127.0.0.1",))
        self.stranger_gateway = self.stranger.issue("stranger-gateway", client=True)

    def mutual(self, worker: Issued | None = None) -> ServerTLS:
        """A worker's TLS asking for a client certificate from our CA."""
        worker = worker or self.worker
        return ServerTLS(worker.cert_file, worker.key_file, self.ca.ca_file)

    def client(self, cert: Issued | None = None, **extra: str) -> WorkerTLS:
        """The gateway's TLS trusting our CA, with `cert` as its client certificate."""
        if cert is None:
            return WorkerTLS(ca_file=self.ca.ca_file, **extra)
        return WorkerTLS(self.ca.ca_file, cert.cert_file, cert.key_file, **extra)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> PKI:
    return PKI(tmp_path_factory.mktemp("pki"))


def tls_gateway(gateway_with, address: str, tls: WorkerTLS | None):
    return gateway_with(models=(ModelConfig(MODEL, workers=(address,)),), worker_tls=tls)


def chat(gw, text: str = "over tls") -> httpx.Response:
    body = {"model": MODEL, "messages": user(text)}
    return httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=HANG_GUARD)


def assert_unavailable(response: httpx.Response) -> None:
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "engine_unavailable"


def test_mutual_tls_to_a_worker(gateway_with, serve_engines, pki):
    (worker,) = serve_engines(DemoEngine(MODEL), tls=pki.mutual())
    gw = tls_gateway(gateway_with, worker.address, pki.client(pki.gateway))
    response = chat(gw)
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"] == "over tls"
    body = {"model": MODEL, "messages": user("a b c"), "stream": True}
    streamed = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=HANG_GUARD)
    assert streamed.status_code == 200
    assert streamed.text.endswith("data: [DONE]\n\n")


def test_plain_tls_and_a_server_name_override(gateway_with, serve_engines, pki):
    (plain,) = serve_engines(
        DemoEngine(MODEL), tls=ServerTLS(pki.worker.cert_file, pki.worker.key_file)
    )
    named = ServerTLS(pki.named_worker.cert_file, pki.named_worker.key_file)
    (by_name,) = serve_engines(DemoEngine(MODEL), tls=named)
    assert chat(tls_gateway(gateway_with, plain.address, pki.client())).status_code == 200
    # the certificate names engine.furnace.internal, not the address dialled
    override = pki.client(server_name="engine.furnace.internal")
    assert chat(tls_gateway(gateway_with, by_name.address, override)).status_code == 200
    assert_unavailable(chat(tls_gateway(gateway_with, by_name.address, pki.client())))


def test_a_worker_without_the_right_certificate_is_refused(gateway_with, serve_engines, pki):
    stranger = ServerTLS(pki.stranger_worker.cert_file, pki.stranger_worker.key_file)
    (worker,) = serve_engines(DemoEngine(MODEL), tls=stranger)
    gw = tls_gateway(gateway_with, worker.address, pki.client(pki.gateway))
    assert_unavailable(chat(gw))

    def state() -> str:
        (worker,) = httpx.get(gw.url + "/admin/workers", timeout=HANG_GUARD).json()["models"][0][
            "workers"
        ]
        return worker["state"]

    # its health checks fail the handshake too: the gateway marks it not serving
    wait_until(lambda: state() == "not_serving", "the worker to be marked not serving")


@pytest.mark.parametrize("client_cert", ["none", "stranger's"])
def test_an_mtls_worker_refuses_a_gateway_without_its_certificate(
    gateway_with, serve_engines, pki, client_cert
):
    (worker,) = serve_engines(DemoEngine(MODEL), tls=pki.mutual())
    cert = None if client_cert == "none" else pki.stranger_gateway
    assert_unavailable(chat(tls_gateway(gateway_with, worker.address, pki.client(cert))))


def test_what_grpc_says_when_the_handshake_fails(server_loop, serve_engines, pki):
    """A refused handshake is a connection failure (UNAVAILABLE), never a status
    the worker sends: hence 503 engine_unavailable, not 502 engine_auth_failed."""
    (worker,) = serve_engines(DemoEngine(MODEL), tls=pki.mutual())

    async def describe(tls: WorkerTLS | None) -> object:
        credentials = None
        if tls is not None:
            credentials = client_credentials(
                tls.ca_file, tls.cert_file, tls.key_file, tls.server_name
            )
        client = FurnaceGrpcUpstream(worker.address, credentials)
        try:
            return await client.describe(2.0)
        except errors.GatewayError as error:
            return error
        finally:
            await client.close()

    for tls in (None, pki.client(), pki.client(pki.stranger_gateway)):
        refused = server_loop.call(describe(tls))
        assert isinstance(refused, errors.Unavailable), refused
    described = server_loop.call(describe(pki.client(pki.gateway)))
    assert [m.name for m in described] == [MODEL]


def test_worker_command_serves_mutual_tls(gateway_with, pki):
    port = free_port()
    flags = ("--tls-cert", pki.worker.cert_file, "--tls-key", pki.worker.key_file)
    args = ("--model", MODEL, *flags, "--tls-client-ca", pki.ca.ca_file)
    with worker_process(port, *args):
        address = f"127.0.0.1:{port}"
        assert chat(tls_gateway(gateway_with, address, pki.client(pki.gateway))).status_code == 200
        assert_unavailable(chat(tls_gateway(gateway_with, address, None)))


def test_worker_command_checks_its_tls_flags(pki):
    for args, message in (
        (("--tls-cert", pki.worker.cert_file), "--tls-cert and --tls-key go together"),
        (("--tls-client-ca", pki.ca.ca_file), "--tls-client-ca needs --tls-cert"),
        (("--tls-cert", "/nonexistent.pem", "--tls-key", pki.worker.key_file), "cannot read"),
    ):
        result = subprocess.run(
            [sys.executable, "-m", "gateway", "worker", "--port", "0", *args],
            capture_output=True,
            text=True,
            timeout=HANG_GUARD,
        )
        assert result.returncode != 0
        assert message in result.stderr
