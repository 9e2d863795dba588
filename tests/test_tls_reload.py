"""Certificates rotated in place (as cert-manager renews them) take effect with
no restart: a worker serves the new certificate on the next handshake, and a
gateway builds new channels with its new client certificate."""

import shutil
from pathlib import Path

import httpx

from gateway.config import ModelConfig, WorkerTLS
from gateway.protocol import errors
from gateway.protocol.tls import ServerTLS, client_credentials
from gateway.upstreams.furnace_grpc import FurnaceGrpcUpstream
from gateway.worker.demo import DemoEngine
from tests.support.certs import CertificateAuthority, Issued
from tests.support.requests import user
from tests.support.waiting import HANG_GUARD, wait_until

MODEL = "tls-reload"


def install(issued: Issued, cert_file: Path, key_file: Path) -> None:
    """Rewrites the files in place with another certificate and key."""
    shutil.copyfile(issued.cert_file, cert_file)
    shutil.copyfile(issued.key_file, key_file)


def bundle(path: Path, *cas: CertificateAuthority) -> str:
    path.write_bytes(b"".join(Path(ca.ca_file).read_bytes() for ca in cas))
    return str(path)


def describe(server_loop, address: str, ca_file: str) -> object:
    async def run() -> object:
        client = FurnaceGrpcUpstream(address, client_credentials(ca_file))
        try:
            return [m.name for m in await client.describe(2.0)]
        except errors.GatewayError as error:
            return error
        finally:
            await client.close()

    return server_loop.call(run())


def test_a_worker_serves_its_rotated_certificate(server_loop, serve_engines, tmp_path):
    old = CertificateAuthority(tmp_path, "old-ca")
    new = CertificateAuthority(tmp_path, "new-ca")
    cert_file, key_file = tmp_path / "tls.crt", tmp_path / "tls.key"
    install(old.issue("worker-old", ips=("127.0.0.1",)), cert_file, key_file)
    (worker,) = serve_engines(DemoEngine(MODEL), tls=ServerTLS(str(cert_file), str(key_file)))
    assert describe(server_loop, worker.address, old.ca_file) == [MODEL]
    assert isinstance(describe(server_loop, worker.address, new.ca_file), errors.Unavailable)

    install(new.issue("worker-new", ips=("127.0.0.1",)), cert_file, key_file)
    # the next handshake, no restart: a client trusting only the new CA gets in
    assert describe(server_loop, worker.address, new.ca_file) == [MODEL]
    assert isinstance(describe(server_loop, worker.address, old.ca_file), errors.Unavailable)


def chat(gw) -> httpx.Response:
    body = {"model": MODEL, "messages": user("across the rotation")}
    return httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=HANG_GUARD)


def test_a_gateway_follows_its_rotated_client_certificate(
    gateway_with, serve_engines, server_loop, tmp_path
):
    server_ca = CertificateAuthority(tmp_path, "server-ca")
    old, new = CertificateAuthority(tmp_path, "old-ca"), CertificateAuthority(tmp_path, "new-ca")
    worker_cert = server_ca.issue("worker", ips=("127.0.0.1",))
    client_ca = tmp_path / "client-ca.pem"
    bundle(client_ca, old)
    tls = ServerTLS(worker_cert.cert_file, worker_cert.key_file, str(client_ca))
    (worker,) = serve_engines(DemoEngine(MODEL), tls=tls)
    cert_file, key_file = tmp_path / "client.crt", tmp_path / "client.key"
    install(old.issue("gateway-old", client=True), cert_file, key_file)
    gw = gateway_with(
        models=(ModelConfig(MODEL, workers=(worker.address,)),),
        worker_tls=WorkerTLS(server_ca.ca_file, str(cert_file), str(key_file)),
        health_check_interval=0.1,
    )
    assert chat(gw).status_code == 200

    # the worker's CA bundle rotates first (old and new), then the gateway's certificate
    bundle(client_ca, old, new)
    assert chat(gw).status_code == 200
    install(new.issue("gateway-new", client=True), cert_file, key_file)
    for _ in range(20):  # served all along, on the old channel or the new
        assert chat(gw).status_code == 200

    # the worker now takes only the new CA, and restarts: every connection
    # handshakes again, and only the rotated client certificate gets in
    bundle(client_ca, new)
    port = worker.port
    server_loop.call(worker.stop(0))
    serve_engines(DemoEngine(MODEL), port=port, tls=tls)
    wait_until(lambda: chat(gw).status_code == 200, "the gateway to reach the worker again")
    workers = httpx.get(gw.url + "/admin/workers", timeout=HANG_GUARD).json()["models"][0]
    assert [w["address"] for w in workers["workers"]] == [worker.address]
