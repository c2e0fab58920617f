"""Two hosts on one machine: two network namespaces joined by a veth pair, and what runs there.

`make_hosts()` makes namespaces ``kvhx<pid>-<n>a`` and ``…b``, a veth pair between them (host
A ``10.213.<k>.1/30``, host B ``…2/30``, k from the pid), loopback and the link up in each,
and starts a real bootstrap server (`kvhandoff serve`, with an auth token) on host A. Every
process runs in its namespace (``ip netns exec``) and in a UTS namespace of its own named
after its host (``unshare --uts``: ``kvh-host-a``, ``kvh-host-b``), as a container or a pod
has: kvhandoff tells hosts apart by boot id and host name (`kvhandoff.transports.hostid`),
so two namespaces that kept this machine's name would have one host id (`auto` then finds
that its shm lane cannot reach the peer and goes cross-host, saying why in its status:
`test_namespaces_sharing_the_machine_name`).

`Agent` is one `xagent.py` process (a long-lived prefill or decode agent driven over stdin);
`Net` acts on the link from host A's end (``ip link set … down/up``; ``tc qdisc … netem``,
or for loss alone an nftables rule where the kernel has no netem, on the direction the KV
bytes take).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvhandoff.engine_sim.process import EngineProcess

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"
START_S = 60.0  # a process start (imports torch, ucxx) on a loaded 2-core machine
DONE_S = 60.0  # bound on a room that is expected to end
TOKEN = "crosshost-token"
SECRET = "crosshost-hmac-secret"
HOST_NAMES = ("kvh-host-a", "kvh-host-b")
HB_S = 0.5  # the agents' heartbeat (the default): a peer silent for 2 of them is lost
RETENTION_S = 2.0  # finished rooms are forgotten after this (so the room count goes to zero)
# the one-sided (nixl) decode's write quarantine in these tests: 3 s (the defaults give 31 s)
WRITE_QUARANTINE = {"write_quarantine_s": 2.0, "stall_timeout_s": 2.0}
QUARANTINE_S = max(WRITE_QUARANTINE["write_quarantine_s"],
                   WRITE_QUARANTINE["stall_timeout_s"] + 2 * HB_S)
_count = itertools.count()


def _tool(name: str) -> str | None:
    return shutil.which(name) or next(
        (p for p in (f"/usr/sbin/{name}", f"/sbin/{name}") if os.access(p, os.X_OK)), None)


IP, TC, UNSHARE, NFT = _tool("ip"), _tool("tc"), _tool("unshare"), _tool("nft")


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, check=check, timeout=30)


def why_no_netns() -> str | None:
    """Why namespaces cannot be made here (None when they can)."""
    if sys.platform != "linux":
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "ip netns needs root (CAP_NET_ADMIN); CI runs these tests as root"
    missing = [n for n, p in (("ip", IP), ("tc", TC), ("unshare", UNSHARE)) if p is None]
    if missing:
        return f"{', '.join(missing)} not installed (iproute2, util-linux)"
    return None


class Skip(Exception):
    """Namespaces cannot be made here; the message says why."""


@dataclass
class Hosts:
    """Two namespaces, the veth between them and the bootstrap server on host A."""

    ns: tuple[str, str]
    ip: tuple[str, str]
    dev: tuple[str, str]
    own_names: bool = True  # each process gets its host's name (False: the machine's)
    bootstrap_url: str = ""
    server: EngineProcess | None = None

    def exec_prefix(self, side: int) -> list[str]:
        """The command prefix that runs a program on host `side` (0: A, 1: B)."""
        assert IP is not None and UNSHARE is not None
        run = [IP, "netns", "exec", self.ns[side]]
        if not self.own_names:
            return run
        return [*run, UNSHARE, "--uts", "sh", "-c",
                f'hostname {HOST_NAMES[side]} && exec "$@"', "sh"]

    def pids(self, side: int) -> set[int]:
        assert IP is not None
        out = sh(IP, "netns", "pids", self.ns[side], check=False).stdout
        return {int(x) for x in out.split()}

    def strays(self) -> set[int]:
        """Processes in either namespace other than the bootstrap server."""
        server = self.server.proc.pid if self.server else None
        return (self.pids(0) | self.pids(1)) - {server}


def _env(**extra: str) -> dict[str, str]:
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{path}" if path else str(SRC),
            **extra}


def start_process(cmd: list[str], role: str, **env: str) -> EngineProcess:
    """A process whose stdout lines are JSON events (other lines become ``line`` events)."""
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env(**env),
                            start_new_session=True)
    sp = EngineProcess(role=role, proc=proc)

    def read_out() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                sp.events.put(json.loads(line))
            except json.JSONDecodeError:
                sp.events.put({"event": "line", "text": line.strip()})
        sp.events.put({"event": "eof"})

    def read_err() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            sp.stderr_tail.append(line)
            del sp.stderr_tail[:-200]

    threading.Thread(target=read_out, daemon=True).start()
    threading.Thread(target=read_err, daemon=True).start()
    return sp


def _delete(ns: str) -> None:
    assert IP is not None
    for pid in sh(IP, "netns", "pids", ns, check=False).stdout.split():
        try:  # only processes of this run live in a namespace it named
            os.kill(int(pid), 9)
        except (ProcessLookupError, ValueError):
            pass
    sh(IP, "netns", "del", ns, check=False)


@contextmanager
def make_hosts(*, own_names: bool = True) -> Iterator[Hosts]:
    """The two hosts, the link and the bootstrap server; all deleted at the end. Raises
    `Skip` where namespaces cannot be made."""
    why = why_no_netns()
    if why:
        raise Skip(why)
    assert IP is not None
    n = next(_count)
    tag = f"kvhx{os.getpid()}-{n}"
    k = (os.getpid() * 7 + n) % 250 + 2
    h = Hosts(ns=(f"{tag}a", f"{tag}b"), ip=(f"10.213.{k}.1", f"10.213.{k}.2"),
              dev=("kvhxa", "kvhxb"), own_names=own_names)
    with ExitStack() as stack:
        for ns in h.ns:
            made = sh(IP, "netns", "add", ns, check=False)
            if made.returncode != 0:
                raise Skip(f"ip netns add failed (no CAP_NET_ADMIN?): {made.stderr.strip()}")
            stack.callback(_delete, ns)
        veth = sh(IP, "link", "add", h.dev[0], "netns", h.ns[0], "type", "veth", "peer",
                  "name", h.dev[1], "netns", h.ns[1], check=False)
        if veth.returncode != 0:
            raise Skip(f"cannot make a veth pair (a kernel without veth?): "
                       f"{veth.stderr.strip()}")
        for side in (0, 1):
            ns = h.ns[side]
            sh(IP, "-n", ns, "addr", "add", f"{h.ip[side]}/30", "dev", h.dev[side])
            sh(IP, "-n", ns, "link", "set", "lo", "up")
            sh(IP, "-n", ns, "link", "set", h.dev[side], "up")
            # one wire-sized packet at a time (no 64 KB GSO super-packets): a packet lost to
            # an impairment is one segment, as on a real link
            sh(IP, "-n", ns, "link", "set", "dev", h.dev[side], "gso_max_size", "1514",
               check=False)
        if sh(*h.exec_prefix(1), "true", check=False).returncode != 0:
            raise Skip("unshare --uts failed: a host name per namespace needs CAP_SYS_ADMIN")
        server = start_process(
            [*h.exec_prefix(0), sys.executable, "-c",
             "import sys; from kvhandoff.cli import main; sys.exit(main())",
             "serve", "--host", h.ip[0], "--port", "0", "--log-level", "warning"],
            "bootstrap server", KVHANDOFF_AUTH_TOKEN=TOKEN)
        server.proc.stdin.close()  # type: ignore[union-attr]
        stack.callback(server.close, 10)  # waits for the exit, SIGKILL after 10 s + 3 s
        stack.callback(server.signal, signal.SIGTERM)  # uvicorn shuts down on SIGTERM
        ev = server.expect("line", START_S)
        assert "listening on http://" in ev["text"], ev
        h.bootstrap_url = ev["text"].rsplit(" ", 1)[1]
        h.server = server
        yield h


@dataclass
class Net:
    """The link between the two hosts, acted on from host A's end."""

    hosts: Hosts
    changed: list[str] = field(default_factory=list)

    def _ns(self, *args: str, check: bool = True) -> None:
        assert IP is not None
        sh(IP, "netns", "exec", self.hosts.ns[0], *args, check=check)

    def down(self) -> None:
        self.changed.append("link")
        self._ns(IP or "ip", "link", "set", self.hosts.dev[0], "down")

    def up(self) -> None:
        self._ns(IP or "ip", "link", "set", self.hosts.dev[0], "up")

    def impair(self, *, loss_pct: int, delay_ms: int = 0) -> None:
        """Random loss (and a fixed delay) of every packet host A sends over the link: tc
        netem, where the kernel has it (sch_netem); loss alone falls back to an nftables
        rule on the device's egress hook. Raises `Skip` where neither can do it."""
        spec = ["loss", f"{loss_pct}%"] + (["delay", f"{delay_ms}ms"] if delay_ms else [])
        self.changed.append("qdisc")
        assert IP is not None and TC is not None
        got = sh(IP, "netns", "exec", self.hosts.ns[0], TC, "qdisc", "add", "dev",
                 self.hosts.dev[0], "root", "netem", *spec, check=False)
        if got.returncode == 0:
            return
        why = f"tc netem: {got.stderr.strip()} (a kernel without sch_netem)"
        if delay_ms:
            raise Skip(f"{why}; a delay needs netem")
        if NFT is None:
            raise Skip(f"{why}; the loss fallback needs nft (nftables), not installed")
        self.changed.append("nft")
        dev = self.hosts.dev[0]
        for rule in ("add table netdev kvhx",
                     f"add chain netdev kvhx egress {{ type filter hook egress device {dev} "
                     "priority 0; }",
                     "add rule netdev kvhx egress numgen random mod 100 "
                     f"< {loss_pct} counter drop"):
            self._ns(NFT, rule)

    def dropped(self) -> int:
        """Packets the impairment dropped so far (netem's or the nftables rule's count)."""
        assert IP is not None
        if "nft" in self.changed and NFT is not None:
            out = sh(IP, "netns", "exec", self.hosts.ns[0], NFT, "list", "table", "netdev",
                     "kvhx").stdout
            m = re.search(r"counter packets (\d+)", out)
        else:
            out = sh(IP, "netns", "exec", self.hosts.ns[0], TC or "tc", "-s", "qdisc", "show",
                     "dev", self.hosts.dev[0]).stdout
            m = re.search(r"dropped (\d+)", out)
        assert m, out
        return int(m[1])

    def clear(self) -> None:
        """Removes the impairment (netem qdisc or nftables rule)."""
        self._ns(TC or "tc", "qdisc", "del", "dev", self.hosts.dev[0], "root", check=False)
        if NFT is not None and "nft" in self.changed:
            self._ns(NFT, "delete table netdev kvhx", check=False)

    def restore(self) -> None:
        if "link" in self.changed:
            self.up()
        if "qdisc" in self.changed:
            self.clear()
        self.changed.clear()


class Agent:
    """One agent process (`xagent.py`) and its events."""

    def __init__(self, sp: EngineProcess, side: int) -> None:
        self.sp = sp
        self.side = side
        self.address = ""

    @property
    def role(self) -> str:
        return self.sp.role

    def cmd(self, **msg: Any) -> None:
        assert self.sp.proc.stdin is not None
        self.sp.proc.stdin.write(json.dumps(msg) + "\n")
        self.sp.proc.stdin.flush()

    def expect(self, kind: str, timeout: float, **match: Any) -> dict[str, Any]:
        return self.sp.expect(kind, timeout, **match)

    def status(self, timeout: float = DONE_S) -> dict[str, Any]:
        self.cmd(cmd="status")
        return self.expect("status", timeout)

    def close(self, timeout: float = DONE_S) -> int:
        """Closes stdin (the agent closes and exits), bounded; the exit code."""
        return self.sp.close(timeout)


#: the `pair` fixture: pair(transport, **settings) -> (prefill on host A, decode on host B)
AgentPair = Callable[..., tuple[Agent, Agent]]


def agent_settings(hosts: Hosts, side: int, transport: str, **extra: Any) -> dict[str, Any]:
    st: dict[str, Any] = {
        "transport": transport, "agent_host": hosts.ip[side],
        "bootstrap_url": hosts.bootstrap_url, "auth_token": TOKEN, "hmac_secret": SECRET,
        "heartbeat_interval_s": HB_S, "room_retention_s": RETENTION_S}
    if transport == "nixl":  # across hosts a lost prefill's pages wait out the quarantine:
        st.update(WRITE_QUARANTINE)  # max(write_quarantine_s, stall_timeout_s + 2 heartbeats)
    st.update(extra)
    return st


def start_pair(hosts: Hosts, transport: str, started: list[Agent], **extra: Any
               ) -> tuple[Agent, Agent]:
    """A prefill agent on host A and a decode agent on host B (both up when this returns)."""
    agents = []
    for side, role in enumerate(("prefill", "decode")):
        cfg = {"settings": agent_settings(hosts, side, transport, **extra),
               "engine_id": "p" if role == "prefill" else "d", "timeout_s": 30}
        sp = start_process([*hosts.exec_prefix(side), sys.executable,
                            str(HERE / "xagent.py"), role, json.dumps(cfg)], role)
        a = Agent(sp, side)
        started.append(a)
        agents.append(a)
    for a in agents:
        ready = a.expect("ready", START_S)
        a.address = ready["address"]
        if hosts.own_names:
            assert ready["host"] == HOST_NAMES[a.side], ready
    return agents[0], agents[1]


def open_room(p: Agent, d: Agent, seq_len: int, *, prefix: int = 0, layer_ms: float = 0,
              hold_after_layer: int | None = None) -> int:
    """Allocates a room at the bootstrap server, bound to the prefill; starts both sides
    (`hold_after_layer`: the prefill marks the later layers only once the room ended, if it
    is still open: see xagent.py)."""
    p.cmd(cmd="rooms", count=1)
    (room,) = p.expect("rooms", DONE_S)["rooms"]
    d.cmd(cmd="recv", room=room, seq_len=seq_len, prefix=prefix)
    p.cmd(cmd="send", room=room, seq_len=seq_len, layer_ms=layer_ms,
          hold_after_layer=hold_after_layer)
    return int(room)


def handoff(p: Agent, d: Agent, seq_len: int, *, prefix: int = 0
            ) -> tuple[dict[str, Any], dict[str, Any]]:
    """One complete handoff; asserts Success on both sides and every landed byte."""
    room = open_room(p, d, seq_len, prefix=prefix)
    dd = d.expect("done", DONE_S, room=room)
    pd = p.expect("done", DONE_S, room=room)
    assert (pd["state"], dd["state"]) == ("Success", "Success"), (pd["failure"], dd["failure"])
    assert dd["bad_bytes"] == 0, f"{dd['bad_bytes']} bytes differ from the prefill's"
    assert not dd["prefix_touched"], f"{dd['prefix_touched']} bytes of the cached prefix written"
    assert pd["released"] and dd["released"]
    return pd, dd


def wait_until(pred: Callable[[], bool], timeout: float) -> bool:
    """Polls `pred` (state held in another process, read by a command) until true, bounded."""
    deadline = time.monotonic() + timeout
    tick = threading.Event()
    while not pred():
        if time.monotonic() >= deadline:
            return False
        tick.wait(0.1)
    return True


def assert_quiet(a: Agent, *, peers: bool, timeout: float) -> dict[str, Any]:
    """Waits until `a` holds no room (finished ones are forgotten after RETENTION_S), every
    page is back in its pool and, when `peers`, no peer is left; returns the last status."""
    last: dict[str, Any] = {}

    def quiet() -> bool:
        last.update(a.status())
        return (not last["rooms"] and last["free_pages"] == last["total_pages"]
                and (not peers or not last["peers"]))

    ok = wait_until(quiet, timeout)
    assert ok, (f"{a.role} still holds rooms {last['rooms']}, peers "
                f"{[p.get('address', p) for p in last['peers']]}, "
                f"{last['total_pages'] - last['free_pages']} pages after {timeout}s")
    return last
