"""No pickle anywhere in the product: a peer's bytes must never be able to execute code.

Scans every module under src/ (its syntax tree, so comments and docstrings that merely mention
pickle do not count) for imports of the serialisers that can run code on load, and for calls
that deserialise with them under another name: pyzmq's ``recv_pyobj``/``send_pyobj``,
``torch.load``, ``numpy.load(..., allow_pickle=True)``, multiprocessing connections' ``recv``.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
BANNED_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve",
                  "joblib", "copyreg", "multiprocessing.connection"}
BANNED_ATTRS = {"recv_pyobj", "send_pyobj", "recv_serialized", "loads_pickle"}


def offences(tree: ast.AST) -> list[str]:
    out: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [f"import {a.name}" for a in node.names
                    if a.name in BANNED_MODULES or a.name.split(".")[0] in BANNED_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module in BANNED_MODULES or node.module.split(".")[0] in BANNED_MODULES:
                out.append(f"from {node.module} import ...")
        elif isinstance(node, ast.Attribute) and node.attr in BANNED_ATTRS:
            out.append(f".{node.attr}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            owner = f.value.id if isinstance(f.value, ast.Name) else ""
            if owner == "torch" and f.attr == "load":
                out.append("torch.load")
            if f.attr == "load" and owner in ("np", "numpy"):
                for kw in node.keywords:
                    if kw.arg == "allow_pickle" and not (
                            isinstance(kw.value, ast.Constant) and kw.value.value is False):
                        out.append("numpy.load(allow_pickle=...)")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id == "__import__" and node.args and isinstance(
                    node.args[0], ast.Constant) and node.args[0].value in BANNED_MODULES:
                out.append(f"__import__({node.args[0].value!r})")
    return out


def test_scanner_catches_what_it_bans() -> None:
    bad = """
import pickle
from cloudpickle import dumps
import marshal as m
sock.recv_pyobj()
torch.load(path)
np.load(path, allow_pickle=True)
__import__("dill")
"""
    found = offences(ast.parse(bad))
    assert len(found) == 7, found
    assert offences(ast.parse("np.load(p, allow_pickle=False)\nimport json\n")) == []


def test_no_pickle_in_src() -> None:
    files = sorted(SRC.rglob("*.py"))
    assert len(files) > 20  # the scan really covers the package
    found = {str(f.relative_to(SRC)): o for f in files
             if (o := offences(ast.parse(f.read_text(), filename=str(f))))}
    assert found == {}, found
