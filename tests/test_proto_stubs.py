"""The committed stubs are exactly what protos/generate.py makes from the .proto."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _generator():
    spec = importlib.util.spec_from_file_location("generate", ROOT / "protos" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_stubs_match_the_proto(tmp_path):
    generator = _generator()
    generator.generate(tmp_path)
    for name in generator.STUBS:
        fresh = (tmp_path / name).read_text()
        committed = (generator.STUB_DIR / name).read_text()
        assert fresh == committed, f"{name} is stale: run `python protos/generate.py`"


def test_every_rpc_and_field_is_commented():
    lines = (ROOT / "protos/furnace/engine/v1/engine.proto").read_text().splitlines()
    for i, line in enumerate(lines):
        stripped = line.strip()
        is_field = stripped.endswith(";") and "=" in stripped and not stripped.startswith("//")
        if stripped.startswith("rpc ") or is_field:
            assert lines[i - 1].strip().startswith("//"), f"line {i + 1} has no comment: {line}"
