"""Measures the data transports between two processes of this machine (GB/s, decimal).

Workloads (GLM-5.3 page set of DESIGN.md §5 at 16,384 tokens, 4,096 cached):
  contiguous  one region of the same byte count (~872 MB)
  pages       ~24,000 pieces: 78 layers x 256 main-KV pages of 41,984 B and 21 layers x 192
              indexer pages of 8,448 B, at random page slots on both sides (each side its own)
Baseline: memcpy of the same bytes inside one process (contiguous, and page by page).

    .venv/bin/python scripts/transport_probe.py                      # ucx, tcp, inproc; 4 MiB
    .venv/bin/python scripts/transport_probe.py --transports ucx --chunks 1,2,4,8,16
    .venv/bin/python scripts/transport_probe.py --scale 0.1 --reps 1  # quick
    .venv/bin/python scripts/transport_probe.py --transports shm,shm-map,shm-write,shm-write-hash

shm kinds: "shm" receives into plain memory (lane shm/cma: process_vm_writev), "shm-map" into a
kvhandoff shared segment (lane shm/map: the sender maps it); "shm-write" is a one-sided
post_write into a shared segment (the receiver posts nothing), "shm-write-hash" the same with
the fused xxh3 of the source (checksum=True).

The receiver is a child process (this script with --child) driven by JSON lines on stdin/out.
Each run checks the received bytes (xxh3 of the destination stream) against the sender's.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import threading
import time

import numpy as np
import xxhash

MAIN_PAGE = 41_984
IDX_PAGE = 8_448
MAIN_LAYERS, MAIN_PAGES = 78, 256
IDX_LAYERS, IDX_PAGES = 21, 192
SLACK = 1.25  # pool slots per needed page


def page_set(seed: int, scale: float) -> tuple[np.ndarray, np.ndarray, int]:
    """Span list of the page workload at random slots; returns (offsets, nbytes, buf_bytes)."""
    rng = np.random.default_rng(seed)
    n_main = max(1, int(MAIN_LAYERS * MAIN_PAGES * scale))
    n_idx = max(1, int(IDX_LAYERS * IDX_PAGES * scale))
    main_slots = int(n_main * SLACK)
    idx_slots = int(n_idx * SLACK)
    main_off = rng.choice(main_slots, n_main, replace=False).astype(np.int64) * MAIN_PAGE
    idx_off = (main_slots * MAIN_PAGE
               + rng.choice(idx_slots, n_idx, replace=False).astype(np.int64) * IDX_PAGE)
    off = np.concatenate([main_off, idx_off])
    nb = np.concatenate([np.full(n_main, MAIN_PAGE, np.int64), np.full(n_idx, IDX_PAGE,
                                                                        np.int64)])
    return off, nb, main_slots * MAIN_PAGE + idx_slots * IDX_PAGE


def workload(name: str, seed: int, scale: float) -> tuple[np.ndarray, np.ndarray, int]:
    off, nb, size = page_set(seed, scale)
    if name == "pages":
        return off, nb, size
    total = int(nb.sum())
    return np.array([0], np.int64), np.array([total], np.int64), size


class Waiter:
    """An on_done callback: keeps the result, sets an event."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.error: BaseException | None = None

    def __call__(self, exc: BaseException | None) -> None:
        self.error = exc
        self.event.set()

    def wait(self) -> BaseException | None:
        self.event.wait()
        return self.error


def digest(buf: np.ndarray, off: np.ndarray, nb: np.ndarray) -> str:
    h = xxhash.xxh3_64()
    for o, n in zip(off.tolist(), nb.tolist(), strict=True):
        h.update(buf[o:o + n].data)
    return h.hexdigest()


# ---- child (receiver) -------------------------------------------------------------------------

def child() -> None:
    from kvhandoff.settings import Settings
    from kvhandoff.transports import load_transport

    def say(obj: object) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    tr = None
    buf = np.zeros(0, np.uint8)
    for line in sys.stdin:
        msg = json.loads(line)
        cmd = msg["cmd"]
        if cmd == "setup":
            if tr is not None:
                tr.close()
            tr = load_transport(msg["kind"].split("-")[0], Settings(chunk_bytes=msg["chunk"]))
            if msg["kind"].startswith("shm-"):  # a kvhandoff shared segment (shm/map lane)
                from kvhandoff.buffers.shared import SharedSegment

                buf = SharedSegment(msg["size"]).array
            else:
                buf = np.empty(msg["size"], np.uint8)
            buf.fill(0)  # fault the pages in now, not during the timed transfer
            tr.register("kv", buf)
            from kvhandoff.transports import OneSidedTransport

            desc = tr.describe("kv").hex() if isinstance(tr, OneSidedTransport) else None
            say({"address": tr.address.hex(), "descriptor": desc})
        elif cmd == "connect":
            assert tr is not None
            tr.connect("parent", bytes.fromhex(msg["address"]))
            say({"ok": True})
        elif cmd == "recv":
            assert tr is not None
            off = np.asarray(msg["offsets"], np.int64)
            nb = np.asarray(msg["nbytes"], np.int64)
            w = Waiter()
            tr.post_recv("parent", msg["tag"], "kv", off, nb, w)
            say({"posted": True})
            err = w.wait()
            say({"error": None if err is None else str(err),
                 "digest": digest(buf, off, nb) if msg.get("verify") else None})
        elif cmd == "digest":
            off = np.asarray(msg["offsets"], np.int64)
            nb = np.asarray(msg["nbytes"], np.int64)
            say({"digest": digest(buf, off, nb)})
        elif cmd == "exit":
            break
    if tr is not None:
        tr.close()


# ---- parent (sender) --------------------------------------------------------------------------

class Child:
    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, "--child"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.q: queue.Queue[dict[str, object]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.q.put(json.loads(line))

    def ask(self, **msg: object) -> dict[str, object]:
        self.tell(**msg)
        return self.get()

    def tell(self, **msg: object) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()

    def get(self) -> dict[str, object]:
        return self.q.get(timeout=600)

    def close(self) -> None:
        self.tell(cmd="exit")
        self.proc.wait(timeout=60)


def run_transport(kind: str, chunk: int, wl: str, reps: int, scale: float,
                  child: Child) -> dict[str, object]:
    from kvhandoff.settings import Settings
    from kvhandoff.transports import load_transport

    s_off, s_nb, size = workload(wl, 1, scale)
    d_off, d_nb, _ = workload(wl, 2, scale)
    total = int(s_nb.sum())
    src = np.empty(size, np.uint8)
    src[:] = np.resize(np.arange(251, dtype=np.uint8), size)
    tr = load_transport(kind.split("-")[0], Settings(chunk_bytes=chunk))
    tr.register("kv", src)
    setup = child.ask(cmd="setup", kind=kind, chunk=chunk, size=size)
    tr.connect("child", bytes.fromhex(str(setup["address"])))
    child.ask(cmd="connect", address=tr.address.hex())
    times = []
    ok = True
    if "-write" in kind:
        tr.register_remote("child", "kv", bytes.fromhex(str(setup["descriptor"])))
    for rep in range(reps + 1):  # rep 0 warms up
        verify = rep == reps
        if "-write" in kind:  # one-sided: the receiver posts nothing
            dt, digest_ok = _write_once(tr, rep, s_off, s_nb, d_off, d_nb, kind.endswith("hash"),
                                        src)
            if rep:
                times.append(dt)
            if verify:
                got = child.ask(cmd="digest", offsets=d_off.tolist(), nbytes=d_nb.tolist())
                ok = digest_ok and got["digest"] == digest(src, s_off, s_nb)
            continue
        child.tell(cmd="recv", tag=rep, offsets=d_off.tolist(), nbytes=d_nb.tolist(),
                   verify=verify)
        child.get()  # posted
        w = Waiter()
        t0 = time.perf_counter()
        tr.post_send("child", rep, "kv", s_off, s_nb, w)
        err = w.wait()
        res = child.get()
        dt = time.perf_counter() - t0
        if err is not None or res["error"] is not None:
            raise RuntimeError(f"{kind} {wl}: {err} / {res['error']}")
        if rep:
            times.append(dt)
        if verify:
            ok = res["digest"] == digest(src, s_off, s_nb)
    st = tr.status()
    tr.close()
    best = min(times)
    return {"transport": kind, "workload": wl, "chunk_MiB": chunk / (1 << 20), "bytes": total,
            "pieces": int(s_nb.size), "best_s": best, "GBps_best": total / best / 1e9,
            "GBps_median": total / float(np.median(times)) / 1e9, "byte_exact": ok,
            "lanes": list(st.lanes), "degraded": st.degraded}


def _write_once(tr: object, tag: int, s_off: np.ndarray, s_nb: np.ndarray, d_off: np.ndarray,
                d_nb: np.ndarray, checksum: bool, src: np.ndarray) -> tuple[float, bool]:
    """One post_write of the page set, until it landed; (seconds, whether the fused digest is
    right)."""
    done = threading.Event()
    result: list[tuple[BaseException | None, int | None]] = []

    def on_written(err: BaseException | None, dig: int | None) -> None:
        result.append((err, dig))
        done.set()

    from kvhandoff.kv_layout import pair_spans

    plan = pair_spans(s_off, s_nb, d_off, d_nb)
    t0 = time.perf_counter()
    tr.post_write("child", tag, "kv", "kv", plan, on_written,  # type: ignore[attr-defined]
                  checksum=checksum)
    if not done.wait(120):
        raise RuntimeError("shm write: the write did not complete")
    dt = time.perf_counter() - t0
    err, dig = result[0]
    if err is not None:
        raise RuntimeError(f"shm write failed: {err}")
    want = int(xxhash.xxh3_64_intdigest(b"".join(
        src[o:o + n].tobytes() for o, n in zip(s_off.tolist(), s_nb.tolist(), strict=True))))
    return dt, (dig == want) if checksum else True


def run_inproc(chunk: int, wl: str, reps: int, scale: float) -> dict[str, object]:
    from kvhandoff.settings import Settings
    from kvhandoff.transports import load_transport

    s_off, s_nb, size = workload(wl, 1, scale)
    d_off, d_nb, _ = workload(wl, 2, scale)
    src = np.empty(size, np.uint8)
    src[:] = np.resize(np.arange(251, dtype=np.uint8), size)
    dst = np.empty(size, np.uint8)
    dst.fill(0)
    a = load_transport("inproc", Settings(chunk_bytes=chunk))
    b = load_transport("inproc", Settings(chunk_bytes=chunk))
    a.register("kv", src)
    b.register("kv", dst)
    a.connect("b", b.address)
    b.connect("a", a.address)
    times = []
    for rep in range(reps + 1):
        wr, ws = Waiter(), Waiter()
        t0 = time.perf_counter()
        b.post_recv("a", rep, "kv", d_off, d_nb, wr)
        a.post_send("b", rep, "kv", s_off, s_nb, ws)
        if wr.wait() is not None or ws.wait() is not None:
            raise RuntimeError(f"inproc {wl}: {wr.error} / {ws.error}")
        if rep:
            times.append(time.perf_counter() - t0)
    ok = digest(dst, d_off, d_nb) == digest(src, s_off, s_nb)
    a.close()
    b.close()
    total = int(s_nb.sum())
    return {"transport": "inproc", "workload": wl, "chunk_MiB": chunk / (1 << 20),
            "bytes": total, "pieces": int(s_nb.size), "best_s": min(times),
            "GBps_best": total / min(times) / 1e9,
            "GBps_median": total / float(np.median(times)) / 1e9, "byte_exact": ok,
            "lanes": ["memcpy"], "degraded": False}


def memcpy_baseline(wl: str, reps: int, scale: float) -> dict[str, object]:
    s_off, s_nb, size = workload(wl, 1, scale)
    d_off, d_nb, _ = workload(wl, 2, scale)
    src = np.empty(size, np.uint8)
    src[:] = 7
    dst = np.empty(size, np.uint8)
    dst.fill(0)
    so, do, nb = s_off.tolist(), d_off.tolist(), s_nb.tolist()
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        for s, d, n in zip(so, do, nb, strict=True):
            dst[d:d + n] = src[s:s + n]
        times.append(time.perf_counter() - t0)
    total = int(s_nb.sum())
    best = min(times[1:])
    return {"transport": "memcpy", "workload": wl, "chunk_MiB": None, "bytes": total,
            "pieces": len(nb), "best_s": best, "GBps_best": total / best / 1e9,
            "GBps_median": total / float(np.median(times[1:])) / 1e9, "byte_exact": True,
            "lanes": ["numpy"], "degraded": False}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--transports", default="ucx,tcp,inproc")
    ap.add_argument("--workloads", default="contiguous,pages")
    ap.add_argument("--chunks", default="4", help="chunk sizes in MiB, comma-separated")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of the page set")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    if args.child:
        child()
        return
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    results = []
    wls = args.workloads.split(",")
    for wl in wls:
        results.append(memcpy_baseline(wl, args.reps, args.scale))
        print(json.dumps(results[-1]), flush=True)
    kid = None
    for kind in args.transports.split(","):
        for chunk_mib in args.chunks.split(","):
            chunk = int(float(chunk_mib) * (1 << 20))
            for wl in wls:
                if kind == "inproc":
                    r = run_inproc(chunk, wl, args.reps, args.scale)
                else:
                    kid = kid or Child()
                    r = run_transport(kind, chunk, wl, args.reps, args.scale, kid)
                results.append(r)
                print(json.dumps(r), flush=True)
    if kid is not None:
        kid.close()
    print()
    print(f"{'transport':<10}{'workload':<12}{'chunk MiB':>10}{'pieces':>8}{'MB':>8}"
          f"{'GB/s best':>11}{'GB/s med':>10}  exact  lanes")
    for r in results:
        chunk_col = "-" if r["chunk_MiB"] is None else f"{r['chunk_MiB']:g}"
        print(f"{r['transport']:<10}{r['workload']:<12}{chunk_col:>10}{r['pieces']:>8}"
              f"{r['bytes'] / 1e6:>8.0f}{r['GBps_best']:>11.2f}{r['GBps_median']:>10.2f}  "
              f"{str(r['byte_exact']):<6} {','.join(r['lanes'])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
