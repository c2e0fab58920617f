"""Import boundaries: an agent importing the client does not load the server stack, and the
production `serve` command does not import from a `testing` module."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import kvhandoff

SRC = Path(kvhandoff.__file__).parent


def _modules_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport sys\nprint('\\n'.join(sys.modules))"],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout
    return set(out.split())


def test_client_import_loads_no_fastapi_starlette_or_uvicorn() -> None:
    mods = _modules_after("import kvhandoff.bootstrap_server.client")
    assert "kvhandoff.bootstrap_server.client" in mods
    loaded = {m for m in mods if m.split(".")[0] in ("fastapi", "starlette", "uvicorn")}
    assert not loaded, sorted(loaded)[:10]
    assert "kvhandoff.bootstrap_server.app" not in mods


def test_package_names_still_resolve_lazily() -> None:
    import kvhandoff.bootstrap_server as bs

    for name in bs.__all__:
        assert getattr(bs, name) is not None, name
    assert bs.create_app.__module__ == "kvhandoff.bootstrap_server.app"


def test_serve_command_imports_nothing_from_testing() -> None:
    tree = ast.parse((SRC / "commands" / "serve.py").read_text())
    imported = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert imported, "serve.py imports nothing?"
    assert not [m for m in imported if "testing" in m.split(".")], imported


def test_no_bootstrap_server_file_over_600_lines() -> None:
    sizes = {p.name: len(p.read_text().splitlines())
             for p in (SRC / "bootstrap_server").rglob("*.py")}
    assert sizes and max(sizes.values()) <= 600, sizes
