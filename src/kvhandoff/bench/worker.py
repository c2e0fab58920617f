"""A bench child process: `python -m kvhandoff.bench.worker raw|prefill|decode`.

It reads one JSON command per line on stdin and answers with JSON lines on stdout (never pickle).
Times are `time.monotonic()` stamps: the parent subtracts stamps of two processes of the same
host (CLOCK_MONOTONIC is system-wide on Linux), so a figure spans from the moment the sender
starts to the moment the receiver has every byte, without the parent's pipe latency.

- raw: a receiver on the bare transport (`load_transport`), one registered contiguous buffer.
  Commands: setup{kind, nbytes, chunk_bytes} -> {address}; connect{address}; recv{tag,
  nbytes, verify} -> {posted} then {t_done, error, digest}; for transports with one-sided
  writes (the parent writes, as the agents do) describe -> {descriptor} and digest{nbytes}.
- prefill / decode: one TP rank (`tp_rank` of `tp_size`, its own layout: a head-sharded preset
  holds that rank's heads), one `TransferAgent` per checksum mode on the same KV buffers (built
  once). Commands: setup{model, page_size, tp_size, tp_rank, pageset, modes, transport,
  chunk_bytes} -> {addresses}; open{room, mode, readers} (prefill: `readers` decode ranks read
  from this rank) / open{room, mode, peer} (decode: `peer` is the list of its source ranks'
  addresses; answers once its receives are posted, then {done} at the end); go{room, layer_ms,
  verify} (prefill: marks every layer ready, paced by layer_ms) -> {t0, ...}. With `verify`, the
  answers carry the per-plane digests of `pageset.plane_digests`.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

import numpy as np
import xxhash

_out_lock = threading.Lock()

BENCH_SECRET = "kvhandoff-bench-secret"  # the "+hmac" modes' shared secret


def control_cpu_s(agent: Any) -> float | None:
    """CPU seconds the agent's control thread has used so far (its thread's CPU clock), or
    None where it cannot be read (no such thread, or no per-thread clock on this platform)."""
    th = getattr(getattr(agent, "_loop", None), "_thread", None)
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(th.ident))  # type: ignore[union-attr]
    except (AttributeError, OSError, TypeError, ValueError):
        return None


def say(**obj: Any) -> None:
    with _out_lock:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()


class _Waiter:
    def __init__(self) -> None:
        self.event = threading.Event()
        self.error: BaseException | None = None
        self.t_done = 0.0

    def __call__(self, exc: BaseException | None) -> None:
        self.t_done = time.monotonic()
        self.error = exc
        self.event.set()


def run_raw() -> None:
    from kvhandoff.settings import Settings
    from kvhandoff.transports.base import load_transport

    tr: Any = None
    buf = np.zeros(0, np.uint8)
    try:
        for line in sys.stdin:
            msg = json.loads(line)
            cmd = msg["cmd"]
            if cmd == "setup":
                tr = load_transport(msg["kind"], Settings(transport=msg["kind"],
                                                          chunk_bytes=msg["chunk_bytes"]))
                if msg.get("shared"):  # shm: a kvhandoff shared segment (the map lane)
                    from kvhandoff.buffers.shared import SharedSegment

                    buf = SharedSegment(int(msg["nbytes"])).array
                else:
                    buf = np.zeros(int(msg["nbytes"]), np.uint8)
                buf[:] = 0  # pages faulted in now, not during the first receive
                tr.register("raw", buf)
                say(address=tr.address.hex())
            elif cmd == "connect":
                tr.connect("parent", bytes.fromhex(msg["address"]))
                say(ok=True)
            elif cmd == "recv":
                n = int(msg["nbytes"])
                w = _Waiter()
                tr.post_recv("parent", int(msg["tag"]), "raw", np.array([0], np.int64),
                             np.array([n], np.int64), w)
                say(posted=True)
                if not w.event.wait(float(msg.get("timeout_s", 120))):
                    say(error="raw receive timed out", t_done=None, digest=None)
                    continue
                dig = xxhash.xxh3_64_hexdigest(buf[:n].data) if msg.get("verify") else None
                say(t_done=w.t_done, error=None if w.error is None else str(w.error), digest=dig)
            elif cmd == "describe":  # one-sided transports: the parent writes into "raw"
                say(descriptor=tr.describe("raw").hex())
            elif cmd == "digest":  # of what a one-sided write left in "raw"
                say(digest=xxhash.xxh3_64_hexdigest(buf[:int(msg["nbytes"])].data))
            elif cmd == "status":
                st = tr.status()
                say(kind=st.kind, lanes=list(st.lanes), degraded=st.degraded)
            elif cmd == "exit":
                break
    finally:
        if tr is not None:
            tr.close()


class _AgentSide:
    """One prefill or decode rank of the bench handoffs."""

    def __init__(self, role: str, msg: dict[str, Any]) -> None:
        from kvhandoff.bench.pageset import PageSet, layers_of, rank_spec
        from kvhandoff.buffers.bufferset import allocate
        from kvhandoff.settings import Settings
        from kvhandoff.transfer import TransferAgent

        self.role = role
        self.rank = int(msg.get("tp_rank", 0))
        self.spec = rank_spec(msg["model"], int(msg["page_size"]), int(msg.get("tp_size", 1)),
                              self.rank)
        self.pageset = PageSet.from_msg(msg["pageset"])
        self.layers = layers_of(self.spec)
        self.timeout_s = float(msg.get("timeout_s", 120))
        pool = (self.pageset.src_num_pages if role == "prefill"
                else self.pageset.dst_num_pages) * int(msg.get("slots", 1))
        if role == "decode" and msg.get("shared_pool"):
            from kvhandoff.buffers.shared import allocate_shared

            bufs = allocate_shared(self.spec, pool)  # shm: the prefill maps and writes it
            for per_layer in bufs.values():
                for t in per_layer.values():
                    t.numpy()[:] = 0  # faulted in now, as allocate's zeros
        else:
            bufs = allocate(self.spec, pool)
        if role == "prefill":  # random bytes: the handoff must not depend on content
            rng = np.random.default_rng(int(msg.get("seed", 0)))
            for per_layer in bufs.values():
                for t in per_layer.values():
                    t.numpy()[:] = rng.integers(0, 256, t.numel(), dtype=np.uint8)
        self.agents: dict[str, Any] = {}
        for mode in msg["modes"]:
            # "<checksum>" or "<checksum>+hmac": the latter's agents share a secret (every
            # control message after the Hello sealed; docs/SECURITY.md)
            checksum, _, auth = mode.partition("+")
            st = Settings(transport=msg["transport"], checksum=checksum,
                          chunk_bytes=int(msg["chunk_bytes"]), stall_timeout_s=self.timeout_s,
                          hmac_secret=BENCH_SECRET if auth == "hmac" else None)
            if msg.get("heartbeat_s"):  # rooms mode (bench/rooms.py says why)
                st = st.model_copy(update={"heartbeat_interval_s": float(msg["heartbeat_s"])})
            self.agents[mode] = TransferAgent(role, self.spec, bufs, st,
                                              engine_id=f"bench-{role}{self.rank}-{mode}")
        self.handles: dict[int, Any] = {}
        first = next(iter(self.agents.values()))
        self.buffers = first.buffers

    def digest(self) -> dict[str, str]:
        from kvhandoff.bench.pageset import plane_digests

        return plane_digests(self.buffers.array, self.spec, self.pageset,
                             side="src" if self.role == "prefill" else "dst")

    def open(self, msg: dict[str, Any]) -> None:
        room, mode = int(msg["room"]), msg["mode"]
        ps = self.pageset
        agent = self.agents[mode]
        if self.role == "prefill":
            self.handles[room] = agent.sender(room, pages=ps.src_pages, seq_len=ps.seq_len,
                                              num_decode_ranks=int(msg.get("readers", 1)))
            say(opened=room)
            return
        from kvhandoff.state_machine import KVPoll

        rv = agent.receiver(room, peer=msg["peer"])  # one address, or one per source rank
        rv.init(ps.dst_pages, ps.seq_len, ps.prefix)
        # the decode agent posts every receive when the transfer is accepted (by every source
        # rank); the timed part must not include the handshake, so answer only then (bounded
        # poll of the room state)
        deadline = time.monotonic() + self.timeout_s
        while rv.poll() in (KVPoll.Bootstrapping,) and time.monotonic() < deadline:
            time.sleep(0.0005)
        say(accepted=room, state=rv.poll().name)
        self.handles[room] = rv
        threading.Thread(target=self._finish, args=(room, rv, msg.get("verify", False),
                                                    time.process_time()), daemon=True).start()

    def _finish(self, room: int, rv: Any, verify: bool, cpu0: float) -> None:
        state = rv.wait(self.timeout_s)
        rv.wait_released(5)
        cpu_s = time.process_time() - cpu0  # this process, every thread, during the room
        say(done=room, state=state.name, failure=rv.failure, stats=rv.stats(), cpu_s=cpu_s,
            digest=self.digest() if verify and state.name == "Success" else None)

    def go(self, msg: dict[str, Any]) -> None:
        room = int(msg["room"])
        s = self.handles.pop(room)
        layer_s = float(msg.get("layer_ms", 0)) / 1e3
        cpu0 = time.process_time()
        t0 = time.monotonic()
        # t_ready: when the engine says its last layer is ready (the call, not its return: a
        # thread descheduled after the call returned would otherwise start the tail after the
        # decode's Success on a loaded host)
        t_ready = t0
        if not layer_s:  # every layer written at once (as SGLang hands a room over)
            s.layers_ready(self.layers)
        for i, lid in enumerate(self.layers if layer_s else ()):
            if i:
                time.sleep(max(0.0, t0 + i * layer_s - time.monotonic()))  # simulated compute
            t_ready = time.monotonic()
            s.layer_ready(lid)
        state = s.wait(self.timeout_s)
        s.wait_released(5)
        say(t0=t0, t_ready=t_ready, state=state.name, failure=s.failure, stats=s.stats(),
            cpu_s=time.process_time() - cpu0,
            digest=self.digest() if msg.get("verify") and state.name == "Success" else None)

    def rooms(self, msg: dict[str, Any]) -> None:
        """Rooms mode: `n` rooms (ids `first` on) with `inflight` of them open at once, as
        `inflight` engine threads; thread k serves rooms k, k + inflight, ... on page slot k
        (the page set shifted by k pool sizes), opening the next once the last one's pages
        were released. Prefill: sender, wait until the decode's pages are known, every layer
        ready at once (`layers_ready`; t0 = just before it). Decode: receiver, init, wait (t_seen =
        when the engine could see Success). Answers {rooms: [[room, t, state, failure, timings],
        ...], cpu_s (this process, every thread), control_cpu_s (the agent's control thread
        alone; None where unreadable), wall_s}; timings are the agent's `room_timings` (the
        figures the room's trace spans carry)."""
        from kvhandoff.bench.pageset import PageSet

        ps = PageSet.from_msg(msg["pageset"])
        agent = self.agents[msg["mode"]]
        n, inflight, first = int(msg["n"]), int(msg["inflight"]), int(msg["first"])
        to = self.timeout_s
        records: list[list[Any] | None] = [None] * n
        errors: list[str] = []
        prefill = self.role == "prefill"
        slot = ps.src_num_pages if prefill else ps.dst_num_pages

        def lane(k: int) -> None:
            try:
                for i in range(k, n, inflight):
                    room = first + i
                    if prefill:
                        s = agent.sender(room, pages=ps.src_pages + k * slot,
                                         seq_len=ps.seq_len)
                        s.wait_bootstrapped(to)
                        t = time.monotonic()
                        s.layers_ready(self.layers)
                        state = s.wait(to)
                        s.wait_released(to)
                        records[i] = [room, t, state.name, s.failure, agent.room_timings(room)]
                    else:
                        rv = agent.receiver(room, peer=msg["peer"])
                        rv.init(ps.dst_pages + k * slot, ps.seq_len, ps.prefix)
                        state = rv.wait(to)
                        t = float(rv.stats().get("t_seen") or time.monotonic())
                        rv.wait_released(to)
                        records[i] = [room, t, state.name, rv.failure,
                                      agent.room_timings(room)]
            except Exception as e:  # noqa: BLE001 - reported to the parent
                errors.append(f"{type(e).__name__}: {e}")

        ctl0 = control_cpu_s(agent)
        cpu0, t0 = time.process_time(), time.monotonic()
        threads = [threading.Thread(target=lane, args=(k,), daemon=True)
                   for k in range(min(inflight, n))]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        ctl1 = control_cpu_s(agent)
        say(rooms=records, cpu_s=time.process_time() - cpu0, wall_s=time.monotonic() - t0,
            control_cpu_s=None if ctl0 is None or ctl1 is None else ctl1 - ctl0,
            errors=errors)

    def status(self) -> dict[str, Any]:
        out = {}
        for mode, a in self.agents.items():
            st = a.status()
            c = st["counters"]
            # how the rooms moved: one-sided writes (shm, nixl) or two-sided sends
            out[mode] = {**st["transport"], "rooms_one_sided": c.get("rooms_one_sided", 0),
                         "rooms": c.get("rooms_success", 0) + c.get("rooms_failed", 0),
                         "messages_in": c.get("messages_in", 0),
                         "messages_out": c.get("messages_out", 0)}
        return out

    def close(self) -> None:
        for a in self.agents.values():
            a.close()


def run_agent(role: str) -> None:
    side: _AgentSide | None = None
    try:
        for line in sys.stdin:
            msg = json.loads(line)
            cmd = msg["cmd"]
            if cmd == "setup":
                side = _AgentSide(role, msg)
                say(addresses={m: a.address for m, a in side.agents.items()})
            elif cmd == "open":
                assert side is not None
                side.open(msg)
            elif cmd == "go":
                assert side is not None
                side.go(msg)
            elif cmd == "rooms":
                assert side is not None
                side.rooms(msg)
            elif cmd == "status":
                assert side is not None
                say(status=side.status())
            elif cmd == "exit":
                break
    finally:
        if side is not None:
            side.close()


def main() -> int:
    if len(sys.argv) != 2 or sys.argv[1] not in ("raw", "prefill", "decode", "nixl"):
        print("usage: python -m kvhandoff.bench.worker raw|prefill|decode|nixl", file=sys.stderr)
        return 2
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    try:
        if sys.argv[1] == "raw":
            run_raw()
        elif sys.argv[1] == "nixl":  # the NIXL WRITE baseline (bench/nixl_baseline.py)
            from kvhandoff.bench.nixl_baseline import serve

            serve()
        else:
            run_agent(sys.argv[1])
    except Exception as e:  # report on the channel, then fail loudly
        say(error=f"{type(e).__name__}: {e}")
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
