"""A simulated engine on each side of a handoff, run as real processes (demo, bench, tests).

`python -m kvhandoff.sim prefill|decode '<json config>'` runs one side and prints one JSON
object per line on stdout (its events). `spawn(role, config)` starts such a process and reads
its events; `SimProcess.expect(kind, timeout)` waits for one, bounded.

Page contents are deterministic: byte b of token t of layer L of region R is
``(t * 131 + b * 7 + L * 17 + R * 29 + seed) % 251``, so the decode process checks what landed
without seeing the prefill's memory. Decode fills its cached-prefix indexer pages with a marker
first and checks afterwards that the handoff left them alone (suffix-only indexer).

With ``"plane_salt": true`` each plane's bytes also depend on its name (`plane_salt`), so a
head or key/scale mix-up is caught; GQA head planes (``h<global id>``) get the same bytes on
every rank that holds the head.

Several ranks per engine (heterogeneous TP): config keys ``tp_rank``/``tp_size`` (a head-sharded
preset then gives that rank's heads), ``dp_rank``/``dp_size`` (registration identity), per-room
``num_decode_ranks`` on the prefill side (how many decode ranks read the room from this rank),
and ``peer`` as a list on the decode side (gathering from several prefill ranks).

Prefill config ``wait_for_decode``: start computing once every room left Bootstrapping (the
decode side bootstrapped), as an engine's bootstrap queue does.

Events: ``ready`` (agent address), ``layer`` (prefill: computed and handed over; decode: landed
and verified), ``done`` (per room: state, failure, stats, verification), ``error``.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

PREFIX_MARKER = 0xA5


@functools.lru_cache(maxsize=8)
def _base(first: int, count: int, nbytes: int) -> np.ndarray:
    """``(t * 131 + b * 7) % 251`` for tokens first..first+count, as uint8 (cached: every layer
    of a request shares it, only the offset differs)."""
    t = np.arange(first, first + count, dtype=np.int64)
    b = np.arange(nbytes, dtype=np.int64)
    out: np.ndarray = ((t[:, None] * 131 + b[None, :] * 7) % 251).astype(np.uint8)
    out.flags.writeable = False
    return out


def pattern(t: np.ndarray, nbytes: int, layer: int, region: int, seed: int) -> np.ndarray:
    """The deterministic bytes of tokens `t` (rows) of one plane of `nbytes` per token:
    ``(t * 131 + b * 7 + layer * 17 + region * 29 + seed) % 251``."""
    c = (layer * 17 + region * 29 + seed) % 251
    contiguous = t.size and t[-1] - t[0] + 1 == t.size and np.all(np.diff(t) == 1)
    if contiguous:
        base = _base(int(t[0]), int(t.size), nbytes)
    else:
        tt = t.astype(np.int64)[:, None]
        base = ((tt * 131 + np.arange(nbytes, dtype=np.int64)[None, :] * 7) % 251).astype(
            np.uint8)
    lut = ((np.arange(256, dtype=np.int64) + c) % 251).astype(np.uint8)
    out: np.ndarray = lut[base]  # (base + c) % 251 in one uint8 table lookup
    return out


def plane_salt(name: str) -> int:
    """A per-plane offset of the pattern (``plane_salt`` mode): head planes ``h<id>`` get
    ``3 * id + 1`` (distinct below 100 heads), other planes ``100 + crc32(name) % 150``."""
    m = re.fullmatch(r"h(\d+)", name)
    if m:
        return 3 * int(m[1]) + 1
    return 100 + zlib.crc32(name.encode()) % 150


def _plane_view(buf: np.ndarray, page_size: int, page_nbytes: int, plane_off: int,
                plane_bytes: int) -> np.ndarray:
    """(pages, page_size * plane_bytes) view of one plane of every page."""
    pages = buf.reshape(-1, page_nbytes)
    lo = plane_off * page_size
    return pages[:, lo:lo + page_size * plane_bytes]


def write_tokens(buf: np.ndarray, spec: Any, reg_i: int, layer: int, pages: np.ndarray,
                 first_tok: int, end_tok: int, seed: int, *, salt: bool = False) -> None:
    """Writes the pattern of tokens [first_tok, end_tok) into `pages` (page k holds tokens
    first_tok + k*page_size ...). `salt`: offset each plane's pattern by `plane_salt`."""
    reg = spec.regions[reg_i]
    ps = spec.page_size_tokens
    n_pages = -(-(end_tok - first_tok) // ps)
    t = np.arange(first_tok, first_tok + n_pages * ps)
    for off, pl in zip(reg.plane_offsets(), reg.planes, strict=True):
        data = pattern(t, pl.bytes_per_token, layer, reg_i,
                       seed + (plane_salt(pl.name) if salt else 0))
        view = _plane_view(buf, ps, reg.page_nbytes(ps), off, pl.bytes_per_token)
        view[pages[:n_pages]] = data.reshape(n_pages, ps * pl.bytes_per_token)


def check_tokens(buf: np.ndarray, spec: Any, reg_i: int, layer: int, pages: np.ndarray,
                 first_tok: int, end_tok: int, seed: int, *, salt: bool = False) -> int:
    """How many bytes of tokens [first_tok, end_tok) differ from the pattern."""
    reg = spec.regions[reg_i]
    ps = spec.page_size_tokens
    n_pages = -(-(end_tok - first_tok) // ps)
    t = np.arange(first_tok, first_tok + n_pages * ps)
    valid = (t < end_tok).reshape(n_pages, ps)
    bad = 0
    for off, pl in zip(reg.plane_offsets(), reg.planes, strict=True):
        want = pattern(t, pl.bytes_per_token, layer, reg_i,
                       seed + (plane_salt(pl.name) if salt else 0)).reshape(
            n_pages, ps, pl.bytes_per_token)
        view = _plane_view(buf, ps, reg.page_nbytes(ps), off, pl.bytes_per_token)
        got = view[pages[:n_pages]].reshape(n_pages, ps, pl.bytes_per_token)
        bad += int(np.count_nonzero((got != want) & valid[:, :, None]))
    return bad


def _free(pool: Any, pages: np.ndarray, room: int) -> None:
    pool.free(pages)


def _emit(kind: str, **fields: Any) -> None:
    sys.stdout.write(json.dumps({"event": kind, "t": time.monotonic(), **fields}) + "\n")
    sys.stdout.flush()


def _layout(cfg: dict[str, Any]) -> Any:
    from kvhandoff.kv_layout import preset
    from kvhandoff.kv_layout.presets import PRESETS

    model = cfg.get("model", "glm-5.3")
    kw: dict[str, Any] = {}
    if cfg.get("page_size"):
        kw["page_size_tokens"] = cfg["page_size"]
    factory = PRESETS.get(model)
    if factory is not None and "tp_size" in inspect.signature(factory).parameters:
        kw["tp_size"] = int(cfg.get("tp_size", 1))  # head-sharded: this rank's heads
        kw["tp_rank"] = int(cfg.get("tp_rank", 0))
    spec = preset(model, **kw)
    if cfg.get("page_size") and not cfg.get("page_rules", False):
        # a page size chosen on purpose (P != D pairing): a simulated engine runs no attention
        # kernel, so the preset's kernel page rules (refused at agent start) are dropped;
        # "page_rules": true keeps them
        spec = spec.without_page_rules()
    return spec


def _agent(role: str, spec: Any, bufs: Any, settings: Any, cfg: dict[str, Any],
           agent_kw: dict[str, Any] | None) -> Any:
    """The agent of this rank, with its engine identity (engine_id, dp/tp rank and size);
    `agent_kw` adds keyword arguments (a transport, an effect filter: tests' faults)."""
    from kvhandoff.transfer import TransferAgent

    return TransferAgent(role, spec, bufs, settings, engine_id=cfg.get("engine_id", role),
                         dp_rank=int(cfg.get("dp_rank", 0)), dp_size=int(cfg.get("dp_size", 1)),
                         tp_rank=int(cfg.get("tp_rank", 0)), tp_size=int(cfg.get("tp_size", 1)),
                         **(agent_kw or {}))


def _buffers(spec: Any, num_pages: int, cfg: dict[str, Any]) -> Any:
    """The KV buffers: CPU torch tensors, or numpy arrays with ``"numpy_buffers": true`` (the
    agent takes both; numpy spares the process the torch import, for many-rank tests); numpy
    views of a kvhandoff shared segment with ``"shared_buffers": true`` (the shm map lane)."""
    from kvhandoff.transfer import allocate

    if cfg.get("shared_buffers"):
        from kvhandoff.buffers.shared import allocate_shared

        return allocate_shared(spec, num_pages, numpy_arrays=True)
    if not cfg.get("numpy_buffers"):
        return allocate(spec, num_pages)
    ps = spec.page_size_tokens
    return {reg.name: {lid: np.zeros(reg.page_nbytes(ps) * num_pages, dtype=np.uint8)
                       for lid in reg.layer_ids} for reg in spec.regions}


def _settings(cfg: dict[str, Any]) -> Any:
    from kvhandoff.settings import Settings

    return Settings(**cfg.get("settings", {}))


def run_prefill(cfg: dict[str, Any], agent_kw: dict[str, Any] | None = None) -> int:
    from kvhandoff.transfer import PagePool

    spec = _layout(cfg)
    settings = _settings(cfg)
    rooms = cfg["rooms"]  # [{"room": id, "seq_len": n}]
    ps = spec.page_size_tokens
    need = sum(-(-r["seq_len"] // ps) for r in rooms)
    pool = PagePool(need + cfg.get("spare_pages", 8), seed=cfg.get("seed", 0))
    bufs = _buffers(spec, pool.num_pages, cfg)
    seed = int(cfg.get("seed", 0))
    layer_s = float(cfg.get("layer_ms", 0)) / 1e3
    salt = bool(cfg.get("plane_salt", False))
    with _agent("prefill", spec, bufs, settings, cfg, agent_kw) as agent:
        _emit("ready", address=agent.address, generation=agent.generation,
              status=agent.status())
        if agent._registration is not None:
            agent._registration.registered.wait(settings.bootstrap_timeout_s)
            _emit("registered", ok=agent._registration.registered.is_set())
        senders = []
        for r in rooms:
            pages = pool.alloc(-(-r["seq_len"] // ps))
            s = agent.sender(r["room"], pages=pages, seq_len=r["seq_len"],
                             on_release=functools.partial(_free, pool, pages),
                             num_decode_ranks=int(r.get("num_decode_ranks", 1)),
                             request_id=r.get("request_id"))
            senders.append((r, s, pages))
        if cfg.get("wait_for_decode"):
            # as SGLang's prefill bootstrap queue: schedule the request once its decode side
            # has bootstrapped (the room left Bootstrapping), bounded by the bootstrap timeout
            from kvhandoff.state_machine import KVPoll

            until = time.monotonic() + settings.bootstrap_timeout_s
            while time.monotonic() < until and any(
                    s.poll() is KVPoll.Bootstrapping for _, s, _ in senders):
                time.sleep(0.001)  # a scheduler tick of the simulated engine
            _emit("scheduled", states=[s.poll().name for _, s, _ in senders])
        layers = sorted({lid for reg in spec.regions for lid in reg.layer_ids})
        for lid in layers:
            t0 = time.monotonic()
            for r, s, pages in senders:
                for ri, reg in enumerate(spec.regions):
                    if lid in reg.layer_ids:
                        write_tokens(agent.buffers.array(reg.name, lid), spec, ri, lid, pages,
                                     0, r["seq_len"], seed, salt=salt)
                if r.get("abort_at_layer") == lid:
                    s.abort("engine aborted the request")
            spent = time.monotonic() - t0
            if layer_s > spent:
                time.sleep(layer_s - spent)  # simulated compute of the layer, not a sync
            for r, s, _ in senders:
                if r.get("abort_at_layer") is None or lid < r["abort_at_layer"]:
                    s.layer_ready(lid)
            _emit("layer", layer=lid)
        _emit("all_ready")
        timeout = float(cfg.get("timeout_s", 60))
        for r, s, _ in senders:
            s.wait(timeout)
            s.wait_released(5)
            _emit("done", room=r["room"], state=s.poll().name, failure=s.failure,
                  released=s.released, stats=s.stats(), timings=agent.room_timings(r["room"]))
        _emit("pool", free=pool.free_count, total=pool.num_pages)
        if cfg.get("linger"):
            sys.stdin.read()  # stay alive (serving) until the parent closes stdin
        _emit("status", status=agent.status())
    return 0


def run_decode(cfg: dict[str, Any], agent_kw: dict[str, Any] | None = None) -> int:
    from kvhandoff.errors import KVHandoffError
    from kvhandoff.kv_layout import SendFrom, page_aligned
    from kvhandoff.state_machine import KVPoll
    from kvhandoff.transfer import PagePool

    spec = _layout(cfg)
    settings = _settings(cfg)
    rooms = cfg["rooms"]  # [{"room", "seq_len", "prefix"}]
    ps = spec.page_size_tokens
    need = sum(-(-r["seq_len"] // ps) for r in rooms)
    pool = PagePool(need + cfg.get("spare_pages", 8), seed=cfg.get("seed", 0) + 1)
    bufs = _buffers(spec, pool.num_pages, cfg)
    seed = int(cfg.get("seed", 0))
    timeout = float(cfg.get("timeout_s", 60))
    salt = bool(cfg.get("plane_salt", False))
    with _agent("decode", spec, bufs, settings, cfg, agent_kw) as agent:
        _emit("ready", address=agent.address, generation=agent.generation,
              status=agent.status())
        recvs = []
        for r in rooms:
            pages = pool.alloc(-(-r["seq_len"] // ps))
            prefix = page_aligned(int(r.get("prefix", 0)), ps)
            for reg in spec.regions:  # the cached prefix decode already holds
                if reg.send_from is SendFrom.DECODE_PREFIX and prefix:
                    for lid in reg.layer_ids:
                        view = agent.buffers.array(reg.name, lid).reshape(
                            -1, reg.page_nbytes(ps))
                        view[pages[:prefix // ps]] = PREFIX_MARKER
            rv = agent.receiver(r["room"], cfg.get("bootstrap_url"), peer=cfg.get("peer"),
                                on_release=functools.partial(_free, pool, pages),
                                request_id=r.get("request_id"))
            rv.init(pages, r["seq_len"], r.get("prefix", 0))
            if r.get("abort_at_layer") == -1:
                rv.abort("decode aborted the request")
            recvs.append((r, rv, pages, prefix))
        layers = sorted({lid for reg in spec.regions for lid in reg.layer_ids})
        for lid in layers:
            ok = True
            for _, rv, _, _ in recvs:
                try:
                    rv.wait_for_layer(lid, timeout)
                except KVHandoffError:  # failed (or timed out): reported by "done" below
                    ok = False
            for r, rv, _, _ in recvs:
                if r.get("abort_at_layer") == lid:
                    rv.abort("decode aborted the request")
            _emit("layer", layer=lid, ok=ok)
            if not ok and all(rv.poll() is KVPoll.Failed for _, rv, _, _ in recvs):
                break
        for r, rv, pages, prefix in recvs:
            state = rv.wait(timeout)
            rv.wait_released(5)
            verify: dict[str, Any] = {}
            if state is KVPoll.Success and cfg.get("verify", True):
                bad = 0
                prefix_bad = 0
                for ri, reg in enumerate(spec.regions):
                    first = prefix if reg.send_from is SendFrom.DECODE_PREFIX else 0
                    for lid in reg.layer_ids:
                        buf = agent.buffers.array(reg.name, lid)
                        bad += check_tokens(buf, spec, ri, lid, pages[first // ps:], first,
                                            r["seq_len"], seed, salt=salt)
                        if first:
                            view = buf.reshape(-1, reg.page_nbytes(ps))
                            prefix_bad += int(np.count_nonzero(
                                view[pages[:first // ps]] != PREFIX_MARKER))
                verify = {"bad_bytes": bad, "prefix_touched_bytes": prefix_bad,
                          "byte_exact": bad == 0 and prefix_bad == 0}
            _emit("done", room=r["room"], state=state.name, failure=rv.failure,
                  released=rv.released, stats=rv.stats(), verify=verify,
                  timings=agent.room_timings(r["room"]))
        _emit("pool", free=pool.free_count, total=pool.num_pages)
        _emit("status", status=agent.status())
    return 0


@dataclass
class SimProcess:
    """A running `python -m kvhandoff.sim` process and its events."""

    role: str
    proc: subprocess.Popen[str]
    events: queue.Queue[dict[str, Any]] = field(default_factory=queue.Queue)
    seen: list[dict[str, Any]] = field(default_factory=list)
    stderr_tail: list[str] = field(default_factory=list)

    def expect(self, kind: str, timeout: float, **match: Any) -> dict[str, Any]:
        """The next event of `kind` (matching `match`), waiting at most `timeout` seconds."""
        deadline = time.monotonic() + timeout
        for ev in self.seen:
            if ev["event"] == kind and all(ev.get(k) == v for k, v in match.items()):
                self.seen.remove(ev)
                return ev
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.role}: no {kind!r} event within {timeout}s; stderr: "
                                   + "".join(self.stderr_tail[-20:]))
            try:
                ev = self.events.get(timeout=left)
            except queue.Empty:
                continue
            if ev["event"] == "eof":
                raise RuntimeError(f"{self.role} exited (rc={self.proc.poll()}) before {kind!r}; "
                                   "stderr: " + "".join(self.stderr_tail[-20:]))
            if ev["event"] == kind and all(ev.get(k) == v for k, v in match.items()):
                return ev
            self.seen.append(ev)

    def all_events(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.seen if e["event"] == kind]

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def close(self, timeout: float = 10) -> int:
        """Ends the process (closing stdin first, then SIGTERM, then SIGKILL)."""
        if self.proc.stdin and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(3)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                return self.proc.wait(3)

    def __enter__(self) -> SimProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.close()


def spawn(role: str, cfg: dict[str, Any], *, env: dict[str, str] | None = None,
          module: str = "kvhandoff.sim") -> SimProcess:
    """Starts `python -m <module> role cfg` (this module, or a wrapper of it that takes the
    same arguments) and a thread reading its events."""
    proc = subprocess.Popen(
        [sys.executable, "-m", module, role, json.dumps(cfg)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, **(env or {})}, start_new_session=True)
    sp = SimProcess(role=role, proc=proc)

    def read_out() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                sp.events.put(json.loads(line))
            except json.JSONDecodeError:
                sp.stderr_tail.append("stdout: " + line)
        sp.events.put({"event": "eof"})

    def read_err() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            sp.stderr_tail.append(line)
            del sp.stderr_tail[:-200]

    threading.Thread(target=read_out, daemon=True).start()
    threading.Thread(target=read_err, daemon=True).start()
    return sp


def main(argv: list[str] | None = None,
         agent_kw: Callable[[], dict[str, Any]] | None = None) -> int:
    """Runs one side; `agent_kw()` (called once) adds keyword arguments to its agent."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] not in ("prefill", "decode"):
        print("usage: python -m kvhandoff.sim prefill|decode '<json config>'", file=sys.stderr)
        return 2
    cfg = json.loads(args[1])
    import logging

    logging.basicConfig(level=os.environ.get("KVHANDOFF_LOG_LEVEL", "WARNING").upper(),
                        stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    try:
        kw = agent_kw() if agent_kw is not None else None
        return run_prefill(cfg, kw) if args[0] == "prefill" else run_decode(cfg, kw)
    except Exception as e:  # report, then fail loudly
        _emit("error", error=f"{type(e).__name__}: {e}")
        raise


if __name__ == "__main__":
    sys.exit(main())
