"""The committed KServe v2 stubs are exactly what protos/generate.py makes from the .proto."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _generator():
    spec = importlib.util.spec_from_file_location("generate", ROOT / "protos" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_kserve_stubs_match_the_proto(tmp_path):
    generator = _generator()
    generator.generate_kserve(tmp_path)
    for name in generator.KSERVE_STUBS:
        fresh = (tmp_path / name).read_text()
        committed = (generator.KSERVE_STUB_DIR / name).read_text()
        assert fresh == committed, f"{name} is stale: run `python protos/generate.py`"


def test_the_service_has_the_calls_the_gateway_makes():
    from gateway.protocol.kserve_v2 import grpc_predict_v2_pb2 as pb

    service = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert service.full_name == "inference.GRPCInferenceService"
    names = {method.name for method in service.methods}
    assert {"ModelInfer", "ModelMetadata", "ModelReady", "ServerLive", "ServerReady"} <= names
