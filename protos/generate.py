"""Generates the Python stubs of the worker protocol into gateway/protocol/v1/, and
those of the KServe v2 inference protocol (tensor workers) into gateway/protocol/kserve_v2/.

One script, so the stubs in the tree always come from the .proto the same way;
`tests/test_proto_stubs.py` runs it into a temporary folder and fails when the
committed stubs differ. Run: `python protos/generate.py [OUT_DIR]`.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"
PROTO = "furnace/engine/v1/engine.proto"
STUB_DIR = ROOT / "gateway" / "protocol" / "v1"
STUBS = ("engine_pb2.py", "engine_pb2.pyi", "engine_pb2_grpc.py")
KSERVE_PROTO = "kserve/v2/grpc_predict_v2.proto"
KSERVE_STUB_DIR = ROOT / "gateway" / "protocol" / "kserve_v2"
KSERVE_STUBS = ("grpc_predict_v2_pb2.py", "grpc_predict_v2_pb2.pyi", "grpc_predict_v2_pb2_grpc.py")


def generate(out_dir: Path) -> None:
    """The worker protocol's stubs into `out_dir`."""
    _generate(PROTO, "furnace.engine.v1", "gateway.protocol.v1", STUBS, out_dir)


def generate_kserve(out_dir: Path) -> None:
    """The KServe v2 protocol's stubs into `out_dir`."""
    _generate(KSERVE_PROTO, "kserve.v2", "gateway.protocol.kserve_v2", KSERVE_STUBS, out_dir)


def _generate(proto: str, package: str, target: str, stubs: tuple[str, ...], out_dir: Path) -> None:
    """Runs protoc, then flattens the stubs into `out_dir` with imports that
    name our package, so they import without touching sys.path."""
    with tempfile.TemporaryDirectory() as raw:
        args = [
            "protoc",
            f"-I{PROTO_DIR}",
            f"--python_out={raw}",
            f"--pyi_out={raw}",
            f"--grpc_python_out={raw}",
            proto,
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        generated = Path(raw).joinpath(*package.split("."))
        out_dir.mkdir(parents=True, exist_ok=True)
        for name in stubs:
            text = (generated / name).read_text()
            text = re.sub(
                rf"^from {re.escape(package)} import ",
                f"from {target} import ",
                text,
                flags=re.MULTILINE,
            )
            (out_dir / name).write_text(text)


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else STUB_DIR)
    generate_kserve(Path(sys.argv[2]) if len(sys.argv) > 2 else KSERVE_STUB_DIR)
