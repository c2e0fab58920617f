"""The direction of imports between the packages under the protocol: `buffers/` (memory, the
checksum algorithms) sits strictly below `protocol/`. The protocol may import buffers; no
module of buffers imports the protocol, the runtime, a transport or the testing kit (read from
the source of every module of the folder, and checked again on a fresh interpreter)."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

import kvhandoff.buffers

BUFFERS_DIR = pathlib.Path(kvhandoff.buffers.__file__).resolve().parent
BUFFERS = sorted(p.name for p in BUFFERS_DIR.glob("*.py"))
ABOVE = ("kvhandoff.protocol", "kvhandoff.runtime", "kvhandoff.transports", "kvhandoff.testing",
         "kvhandoff.transfer", "kvhandoff.integrations", "kvhandoff.commands")


def _imports(path: pathlib.Path) -> set[str]:
    """Every module `path` imports, at any depth of its code (lazy imports included);
    relative imports resolved against the `kvhandoff.buffers` package."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:  # from .x / from ..x
                base = ["kvhandoff", "buffers"][:3 - node.level]
                mod = ".".join([*base, mod] if mod else base)
            found.add(mod)
    return found


def test_the_check_reads_the_whole_buffers_folder() -> None:
    assert {"bufferset.py", "checksum.py", "devsum.py", "pool.py", "shared.py"} <= set(BUFFERS)


@pytest.mark.parametrize("name", BUFFERS)
def test_buffers_import_nothing_above_them(name: str) -> None:
    bad = {m for m in _imports(BUFFERS_DIR / name)
           for up in ABOVE if m == up or m.startswith(up + ".")}
    assert not bad, f"buffers/{name} imports {sorted(bad)}: buffers sit below the protocol"


def test_importing_every_buffers_module_loads_no_protocol_module() -> None:
    mods = ", ".join(f"kvhandoff.buffers.{n[:-3]}" for n in BUFFERS if n != "__init__.py")
    code = (f"import sys, {mods}; "
            f"print(sorted(m for m in sys.modules if m.startswith({ABOVE!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
