"""A room's state has one owner (`protocol/roomstate.py`) and a peer's one owner
(`protocol/peerstate.py`), read from every module's syntax tree:

- no module but `roomstate` touches a leg's `LegMachine` (`.machine`: no apply, no
  progressed, no read): the others go through `LegState`'s methods and properties;
- no module of `protocol/` but `roomstate` assigns a room's or a leg's phase, failure, expected
  legs or done time (`x.phase = ...`, `x.failure = ...`, tuple targets and `setattr` too): they
  move through `RoomState` / `LegState` methods, which check the transition tables;
- no module but `roomstate` writes a leg's `Fence` (`fence.remote_writes = ...`,
  `fence.cancelling.add(...)`, `fence.tags[t] = ...`): each flag moves through the `Fence`
  method that names the protocol event moving it;
- no module of `protocol/` but `peerstate` assigns a peer's state or flags (`p.state = ...`,
  `p.rejected = ...`, `p.writes = ...`; `x.state.phase = ...` anywhere in the package): a
  peer's handshake moves only through the `PeerState` method named for its event, which
  checks `PEER_PHASES`.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PKG = ROOT / "src" / "kvhandoff"
OWNER = PKG / "protocol" / "roomstate.py"
PEER_OWNER = PKG / "protocol" / "peerstate.py"
OWNED = {"phase", "failure", "expected", "readers_told", "t_done"}


def modules(top: Path, owner: Path = OWNER) -> Iterator[Path]:
    yield from sorted(p for p in top.rglob("*.py") if p != owner)


def targets(node: ast.AST) -> Iterator[ast.expr]:
    """The expressions an assignment statement writes (tuple and list targets unpacked)."""
    if isinstance(node, ast.Assign):
        todo = list(node.targets)
    elif isinstance(node, ast.AugAssign | ast.AnnAssign):
        todo = [node.target]
    else:
        return
    while todo:
        t = todo.pop()
        if isinstance(t, ast.Tuple | ast.List):
            todo.extend(t.elts)
        elif isinstance(t, ast.Starred):
            todo.append(t.value)
        else:
            yield t


def where(path: Path) -> str:
    return str(path.relative_to(ROOT)) if ROOT in path.parents else path.name


def machine_uses(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return [f"{where(path)}:{n.lineno}: .machine" for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and n.attr == "machine"]


def _of_self(node: ast.Attribute) -> bool:
    return isinstance(node.value, ast.Name) and node.value.id == "self"


def owned_writes(path: Path, owned: frozenset[str] | set[str] = OWNED, *,
                 own: frozenset[str] = frozenset()) -> list[str]:
    """Writes of the attributes `owned` in `path`; `own`: those `path` owns itself, which it
    may write on `self` (never on another object)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    bad = []
    for n in ast.walk(tree):
        for t in targets(n):
            if (isinstance(t, ast.Attribute) and t.attr in owned
                    and not (t.attr in own and _of_self(t))):
                bad.append(f"{where(path)}:{t.lineno}: .{t.attr} = ...")
        if (isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "setattr"
                and len(n.args) >= 2 and isinstance(n.args[1], ast.Constant)
                and n.args[1].value in owned):
            bad.append(f"{where(path)}:{n.lineno}: setattr(..., {n.args[1].value!r})")
    return bad


#: a peer's handshake state (`peerstate.PeerState`) and the record's field holding it
PEER_OWNED = frozenset({"state", "phase", "rejected", "initiated", "ack_owed", "writes"})


def peer_state_writes(path: Path) -> list[str]:
    """Writes of a peer's state reached through its record anywhere (`<x>.state.phase`,
    `<x>.state.writes`, ...)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    fields = PEER_OWNED - {"state"}
    return [f"{where(path)}:{t.lineno}: .state.{t.attr} = ..."
            for n in ast.walk(tree) for t in targets(n)
            if isinstance(t, ast.Attribute) and t.attr in fields
            and isinstance(t.value, ast.Attribute) and t.value.attr == "state"]


FENCE = {"tags", "cancelling", "stop_failed", "remote_writes", "ack_when_stopped"}
MUTATORS = {"add", "discard", "remove", "pop", "clear", "update", "setdefault", "popitem"}


def _of_fence(node: ast.expr) -> bool:
    """`node` is a flag of a fence: `<...>.fence.<flag>` or `fence.<flag>`."""
    if not (isinstance(node, ast.Attribute) and node.attr in FENCE):
        return False
    owner = node.value
    return ((isinstance(owner, ast.Attribute) and owner.attr == "fence")
            or (isinstance(owner, ast.Name) and owner.id == "fence"))


def fence_writes(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    bad = []
    for n in ast.walk(tree):
        for t in targets(n):
            flag = t.value if isinstance(t, ast.Subscript) else t
            if isinstance(flag, ast.expr) and _of_fence(flag):
                bad.append(f"{where(path)}:{t.lineno}: fence.{flag.attr} written")
        if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                and n.func.attr in MUTATORS and _of_fence(n.func.value)):
            assert isinstance(n.func.value, ast.Attribute)
            bad.append(f"{where(path)}:{n.lineno}: fence.{n.func.value.attr}.{n.func.attr}()")
    return bad


def test_only_roomstate_touches_a_room_machine() -> None:
    bad = [x for p in modules(PKG) if "state_machine" not in p.relative_to(PKG).parts
           for x in machine_uses(p)]
    assert not bad, "a leg's LegMachine touched outside protocol/roomstate.py:\n" + \
        "\n".join(bad)


def test_only_roomstate_moves_a_phase_or_a_failure() -> None:
    bad = [x for p in modules(PKG / "protocol") for x in owned_writes(
        p, own=PEER_OWNED if p == PEER_OWNER else frozenset())]
    assert not bad, ("a room's or leg's state assigned outside protocol/roomstate.py (use "
                     "RoomState / LegState methods):\n" + "\n".join(bad))


def test_only_roomstate_writes_a_fence() -> None:
    bad = [x for p in modules(PKG) for x in fence_writes(p)]
    assert not bad, ("a leg's Fence written outside protocol/roomstate.py (use the Fence "
                     "method of the event):\n" + "\n".join(bad))


def test_only_peerstate_moves_a_peers_state() -> None:
    bad = [x for p in modules(PKG / "protocol", PEER_OWNER)
           for x in owned_writes(p, PEER_OWNED, own=PEER_OWNED if p == OWNER else frozenset())]
    bad += [x for p in modules(PKG, PEER_OWNER) for x in peer_state_writes(p)]
    assert not bad, ("a peer's state or flags assigned outside protocol/peerstate.py (use the "
                     "PeerState method of the event):\n" + "\n".join(sorted(set(bad))))


def test_the_checks_see_what_they_forbid(tmp_path: Path) -> None:
    """Each check finds the forms it names (so that an empty result means something)."""
    p = tmp_path / "m.py"
    p.write_text("r.state.machine.apply(e, now)\n"
                 "g.state.failure = f\n"
                 "r.state.phase, x = LegPhase.READY, 1\n"
                 "s.t_done += 1.0\n"
                 "setattr(s, 'expected', 2)\n"
                 "p.state = PeerState.NEW\n"
                 "r.state.fence.remote_writes = False\n"
                 "fence.cancelling.add(3)\n"
                 "r.state.fence.tags[4] = 1\n"
                 "if fence.remote_writes: pass\n")
    assert machine_uses(p) == ["m.py:1: .machine"]
    assert sorted(owned_writes(p)) == [
        "m.py:2: .failure = ...", "m.py:3: .phase = ...", "m.py:4: .t_done = ...",
        "m.py:5: setattr(..., 'expected')"]
    assert sorted(fence_writes(p)) == ["m.py:7: fence.remote_writes written",
                               "m.py:8: fence.cancelling.add()",
                               "m.py:9: fence.tags written"]
    q = tmp_path / "peers.py"
    q.write_text("p.state = PeerState.NEW\n"
                 "p.rejected, p.initiated = f, True\n"
                 "self.writes = True\n"
                 "agent.peer.state.phase = PeerPhase.MATCHED\n"
                 "if p.state.matched: pass\n")
    assert sorted(owned_writes(q, PEER_OWNED)) == [
        "peers.py:1: .state = ...", "peers.py:2: .initiated = ...",
        "peers.py:2: .rejected = ...", "peers.py:3: .writes = ...",
        "peers.py:4: .phase = ..."]
    # the owner may write its own fields on `self`, never on another object
    assert sorted(owned_writes(q, PEER_OWNED, own=PEER_OWNED)) == [
        "peers.py:1: .state = ...", "peers.py:2: .initiated = ...",
        "peers.py:2: .rejected = ...", "peers.py:4: .phase = ..."]
    assert peer_state_writes(q) == ["peers.py:4: .state.phase = ..."]
