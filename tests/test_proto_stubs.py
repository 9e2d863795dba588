"""The committed stubs (our worker protocol's and KServe v2's) are exactly what
protos/generate.py makes from the .proto files."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _generator():
    spec = importlib.util.spec_from_file_location("generate", ROOT / "protos" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("make", "stubs", "stub_dir"),
    [
        ("generate", "STUBS", "STUB_DIR"),  # our worker protocol
        ("generate_kserve", "KSERVE_STUBS", "KSERVE_STUB_DIR"),  # KServe v2, for tensor workers
    ],
)
def test_stubs_match_the_proto(tmp_path, make, stubs, stub_dir):
    generator = _generator()
    getattr(generator, make)(tmp_path)
    for name in getattr(generator, stubs):
        fresh = (tmp_path / name).read_text()
        committed = (getattr(generator, stub_dir) / name).read_text()
        assert fresh == committed, f"{name} is stale: run `python protos/generate.py`"


def test_the_kserve_service_has_the_calls_the_gateway_makes():
    from gateway.protocol.kserve_v2 import grpc_predict_v2_pb2 as pb

    service = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert service.full_name == "inference.GRPCInferenceService"
    names = {method.name for method in service.methods}
    assert {"ModelInfer", "ModelMetadata", "ModelReady", "ServerLive", "ServerReady"} <= names


def test_every_rpc_and_field_is_commented():
    lines = (ROOT / "protos/furnace/engine/v1/engine.proto").read_text().splitlines()
    for i, line in enumerate(lines):
        stripped = line.strip()
        is_field = stripped.endswith(";") and "=" in stripped and not stripped.startswith("//")
        if stripped.startswith("rpc ") or is_field:
            assert lines[i - 1].strip().startswith("//"), f"line {i + 1} has no comment: {line}"
