"""The docs hold what the code holds: the worker protocol's page is generated from the
commented `.proto` and fresh, the README is a landing page whose links reach the site's pages,
and its two commands are what CI and `make` run. (`mkdocs build --strict` in .ci/run checks the
site's own links, anchors and navigation; test_config_contract.py the configuration table.)"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

_spec = importlib.util.spec_from_file_location("protos_document", ROOT / "protos" / "document.py")
assert _spec is not None and _spec.loader is not None
DOCUMENT = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = DOCUMENT  # its dataclass looks its module up
_spec.loader.exec_module(DOCUMENT)


def first_sh_block(text: str) -> str:
    return text.split("```sh\n", 1)[1].split("```", 1)[0]


def readme_commands() -> list[str]:
    """The commands of the README's "Two commands" block, in order."""
    section = README.read_text().split("## Two commands", 1)[1].split("\n## ", 1)[0]
    block = first_sh_block(section)
    return [line for line in block.splitlines() if line and not line.startswith("#")]


def test_the_worker_protocol_page_is_generated_from_the_proto():
    page = DOCUMENT.PAGE.read_text()
    assert DOCUMENT.render(DOCUMENT.PROTO.read_text()) == page, "run: python protos/document.py"


def test_every_rpc_message_and_enum_of_the_proto_has_its_section():
    text = DOCUMENT.PROTO.read_text()
    declared = set(re.findall(r"^(?:message|enum) (\w+)", text, re.MULTILINE))
    declared |= set(re.findall(r"^  rpc (\w+)\(", text, re.MULTILINE))
    page = DOCUMENT.PAGE.read_text()
    missing = {name for name in declared if f"## {name}\n" not in page and f"`{name}`" not in page}
    assert not missing


def test_the_readme_has_the_two_commands_and_ci_runs_the_second_verbatim():
    demo, tests = readme_commands()
    assert demo.endswith(".venv/bin/furnace-gateway demo")
    assert tests.endswith(".venv/bin/python -m pytest")
    ci = (ROOT / ".ci" / "run").read_text()
    assert f"\n{tests} || exit $?\n" in ci


def test_getting_started_gives_the_readme_commands_to_the_letter():
    section = README.read_text().split("## Two commands", 1)[1]
    page = (ROOT / "docs" / "getting-started.md").read_text()
    assert first_sh_block(page) == first_sh_block(section)


def test_the_readme_is_a_landing_page_whose_links_reach_the_site():
    text = README.read_text()
    assert len(text.splitlines()) <= 160
    links = re.findall(r"\]\((docs/[^)#]+)(?:#[^)]*)?\)", text)
    assert links, "the README links into the site"
    missing = sorted({link for link in links if not (ROOT / link).is_file()})
    assert not missing


def test_the_glossary_names_what_the_code_names():
    """Each name in the glossary's code column is one the code has: a module path that exists,
    or an identifier that the gateway's source or the worker protocol defines."""
    page = (ROOT / "docs" / "concepts" / "glossary.md").read_text()
    source = " ".join(
        path.read_text()
        for path in [*(ROOT / "gateway").rglob("*.py"), *(ROOT / "protos").rglob("*.proto")]
    )
    defined = set(re.findall(r"(?:class|def|message|rpc|enum) (\w+)", source))
    defined |= set(re.findall(r"^\s*(\w+)(?::| =)", source, re.MULTILINE))
    rows = [line.split("|")[3] for line in page.splitlines() if line.startswith("| **")]
    missing = []
    for name in (name for row in rows for name in re.findall(r"`([^`]+)`", row)):
        if name.startswith("gateway."):
            path = ROOT.joinpath(*name.split("."))
            module = path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()
            parent = (
                path.parent.with_suffix(".py").is_file() or (path.parent / "__init__.py").is_file()
            )
            if not (module or (parent and path.name in defined)):
                missing.append(name)
        elif not all(part in defined for part in name.split(".")):
            missing.append(name)
    assert not missing, f"the glossary names what the code does not: {missing}"
