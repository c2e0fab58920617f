"""The package's edges, read from every module's syntax tree (imports inside functions too):

- product code never imports `kvhandoff.testing` (the scaffolding ships for tests and users;
  a production path that needs one of its parts takes it from a product module);
- the agent API (`TransferAgent`, `Sender`, `Receiver`) has one import path,
  `kvhandoff.transfer`, outside `runtime/` that defines it, in src, tests and scripts alike;
  nothing else is imported from `kvhandoff.transfer`;
- `kvhandoff.transfer` and `kvhandoff.engine_sim` load nothing by name (no ``importlib``, no module
  ``__getattr__``): what they hold is what their imports say.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "src" / "kvhandoff"
API = {"TransferAgent", "Sender", "Receiver"}


def imports(path: Path) -> Iterator[tuple[int, str, tuple[str, ...]]]:
    """(line, absolute module, names) of every import in the file (relative ones resolved
    against the file's package)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name, ()
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level and PKG in path.parents:
                rel = path.relative_to(PKG.parent).with_suffix("").parts[:-node.level]
                mod = ".".join([*rel, mod] if mod else rel)
            names = tuple(a.name for a in node.names)
            yield node.lineno, mod, names
            # `from kvhandoff import testing`: the module is a name
            yield from ((node.lineno, f"{mod}.{n}", ()) for n in names)


def modules(*tops: Path) -> Iterator[Path]:
    for top in tops:
        yield from sorted(p for p in top.rglob("*.py") if ".venv" not in p.parts)


def test_product_code_never_imports_testing() -> None:
    bad = [f"{p.relative_to(ROOT)}:{line}: {mod}"
           for p in modules(PKG) if "testing" not in p.relative_to(PKG).parts
           for line, mod, _ in imports(p)
           if mod == "kvhandoff.testing" or mod.startswith("kvhandoff.testing.")]
    assert not bad, "product modules import kvhandoff.testing:\n" + "\n".join(bad)


def test_agent_api_has_one_import_path() -> None:
    homes = (PKG / "runtime", PKG / "transfer.py")
    bad = []
    for p in modules(PKG, ROOT / "tests", ROOT / "scripts"):
        if any(p == h or h in p.parents for h in homes):
            continue
        for line, mod, names in imports(p):
            if mod.startswith("kvhandoff.") and mod != "kvhandoff.transfer" and API & set(names):
                bad.append(f"{p.relative_to(ROOT)}:{line}: from {mod} import "
                           f"{', '.join(sorted(API & set(names)))}")
            if mod == "kvhandoff.transfer" and set(names) - API:
                bad.append(f"{p.relative_to(ROOT)}:{line}: from kvhandoff.transfer import "
                           f"{', '.join(sorted(set(names) - API))} (not the agent API)")
    assert not bad, "import these from kvhandoff.transfer:\n" + "\n".join(bad)


def test_public_modules_load_nothing_by_name() -> None:
    for p in [PKG / "transfer.py", *modules(PKG / "engine_sim")]:
        tree = ast.parse(p.read_text())
        assert not [m for _, m, _ in imports(p) if m.startswith("importlib")], p
        assert not [n for n in tree.body
                    if isinstance(n, ast.FunctionDef) and n.name == "__getattr__"], p


def test_the_agent_api_is_the_runtime_objects() -> None:
    from kvhandoff import transfer
    from kvhandoff.runtime import agent, handles

    assert set(transfer.__all__) == API
    assert transfer.TransferAgent is agent.TransferAgent
    assert (transfer.Sender, transfer.Receiver) == (handles.Sender, handles.Receiver)
