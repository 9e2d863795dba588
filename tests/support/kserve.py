"""KServe's Python model server as a tensor worker for the tests (.tools/kserve, made by
deploy/install-tools.sh), serving the models of tests/support/kserve_model.py over gRPC."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.support.processes import free_port, listening
from tests.support.waiting import wait_until

ROOT = Path(__file__).resolve().parent.parent.parent
KSERVE_PYTHON = ROOT / ".tools" / "kserve" / "bin" / "python"
SCRIPT = Path(__file__).resolve().parent / "kserve_model.py"

#: Every datatype of the protocol, with values at its edges (exact in JSON and on the wire).
EDGE_VALUES: dict[str, list] = {
    "BOOL": [True, False, True],
    "UINT8": [0, 1, 255],
    "UINT16": [0, 1, 65535],
    "UINT32": [0, 1, 2**32 - 1],
    "UINT64": [0, 2**53 + 1, 2**64 - 1],
    "INT8": [-128, 0, 127],
    "INT16": [-32768, 0, 32767],
    "INT32": [-(2**31), 0, 2**31 - 1],
    "INT64": [-(2**63), 2**53 + 1, 2**63 - 1],
    "FP16": [0.5, -2.0, 65504.0],
    "FP32": [0.25, -1.5, 2.0**100],
    "FP64": [0.1, -1e300, 2.0**-1074],
    "BYTES": ["héllo", "", "a longer string, with commas"],
}


class KServeServer:
    """One model server process on loopback ports of its own."""

    def __init__(self, log: Path) -> None:
        if not KSERVE_PYTHON.exists():
            raise RuntimeError(".tools/kserve is missing: run `bash deploy/install-tools.sh`")
        self.grpc_port = free_port()
        self.http_port = free_port()
        self.log = log
        self._log_file = log.open("wb")
        self.process = subprocess.Popen(
            [str(KSERVE_PYTHON), "-P", str(SCRIPT), str(self.grpc_port), str(self.http_port)],
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            cwd=str(log.parent),
        )
        wait_until(
            lambda: listening(self.grpc_port) or self.process.poll() is not None,
            "the KServe model server to listen",
        )
        if self.process.poll() is not None:
            raise RuntimeError(f"the KServe model server exited: {log.read_text()[-2000:]}")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=30)
        self._log_file.close()
