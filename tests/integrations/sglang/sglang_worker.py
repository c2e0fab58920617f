"""One side of a real SGLang PD pair using the kvhandoff backend (run as its own process).

    python sglang_worker.py prefill|decode BOOTSTRAP_PORT

Builds SGLang's manager through ``get_kv_class(TransferBackend("kvhandoff"), ...)`` after SGLang's
plugin loader registered the backend, then drives the rooms of `ROOMS` with the calls and in the
order SGLang's ``prefill.py`` / ``decode.py`` make them (sender: create, poll until bootstrapped,
``pop_decode_prefix_len``, ``init(num_pages, aux_index)``, one ``send`` per chunk, the DSA
suffix pages with the last one, poll; receiver: create, ``try_ensure_parallel_info``,
``init(prefill_dp_rank)``, ``send_metadata(suffix pages, aux_index, [dsa pages],
decode_prefix_len)``, poll). Prints one JSON line per room: the distinct poll values seen, the
``failure_exception()`` text, and (decode) the byte checks.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from typing import Any

import numpy as np
import sglang_env as E

DEADLINE_S = 30.0

# src/dst: physical pages of the whole sequence (token page k -> page src[k] / dst[k])
ROOMS: list[dict[str, Any]] = [
    {"room": 7001, "name": "chunks", "seq": 320, "prefix": 0, "chunks": [2, 2, 1],
     "src": [5, 9, 3, 30, 31], "dst": [40, 2, 17, 18, 11], "aux": (1, 3)},
    {"room": 7002, "name": "cached_prefix", "seq": 480, "prefix": 128, "chunks": [3, 3],
     "src": [1, 2, 3, 4, 6, 7, 8, 10], "dst": [20, 21, 22, 23, 24, 30, 31, 32], "aux": (2, 5)},
    {"room": 7003, "name": "decode_abort", "seq": 192, "prefix": 0, "chunks": [3],
     "src": [12, 13, 14], "dst": [1, 3, 5], "aux": (0, 0)},
    {"room": 7004, "name": "prefill_abort", "seq": 192, "prefix": 0, "chunks": [3],
     "src": [15, 16, 17], "dst": [6, 7, 8], "aux": (4, 1)},
    {"room": 7005, "name": "prefill_dies", "seq": 320, "prefix": 0, "chunks": [2, 3],
     "src": [20, 21, 22, 23, 24], "dst": [9, 10, 12, 13, 14], "aux": (3, 2)},
]


if E.CONFIG != "small":  # the GLM-5.3 pools (78 layers, 21 live indexer layers, ...): a whole
    # sequence and a cached prefix, within the pool's few pages; "aux" is also the request
    # row of the kpool tail ring (seq % index_kpool live tail tokens)
    _ps = 128 if E.CONFIG.endswith("kpool2") else 64
    ROOMS = [
        {"room": 7101, "name": "whole", "seq": 2 * _ps + 45, "prefix": 0, "chunks": [1, 2],
         "src": [3, 0, 2], "dst": [1, 3, 0], "aux": (1, 3)},
        {"room": 7102, "name": "cached_prefix", "seq": 3 * _ps - 1, "prefix": _ps,
         "chunks": [2], "src": [0, 1, 2], "dst": [3, 2, 1], "aux": (4, 2)},
    ]

if E.FULL_SIZE:  # bench_sglang_pair.py: one GLM-5.3 request of 4,096 tokens in 4 chunks
    ROOMS = [{"room": 9001, "name": "bench", "seq": 32768, "prefix": 0,
              "chunks": [16, 16, 16, 16], "src": list(range(0, 64)),
              "dst": list(range(79, 15, -1)), "aux": (1, 2)}]


def emit(**kw: Any) -> None:
    print("RESULT " + json.dumps(kw), flush=True)


def poll_until(handle: Any, done: Any, seen: list[int]) -> int:
    """Polls as SGLang's event loop does until `done(state)`; records each new state."""
    end = time.monotonic() + DEADLINE_S
    while True:
        st = int(handle.poll())
        if not seen or seen[-1] != st:
            seen.append(st)
        if done(st) or time.monotonic() > end:
            return st
        time.sleep(0.002)


def failure_text(handle: Any) -> str | None:
    try:
        handle.failure_exception()
    except Exception as e:  # SGLang's KVTransferError
        return f"{type(e).__name__}: {e}"
    return None


def tail_slots(p: E.Pools, r: dict[str, Any], row: int) -> tuple[list[int], list[int]]:
    """SGLang's DSA_TAIL state indices of the room's request in `row`, and its live ring
    slots in token order."""
    import sglang_pools as P

    if p.sglang.config.kpool <= 1:
        return [], []
    six = P.tail_indices(p.sglang, row, r["seq"])
    if not six:
        return [], []
    _, o1, n1, o2, n2, _ = six
    return six, [*range(o1, o1 + n1), *range(o2, o2 + n2)]


def state_indices(p: E.Pools, r: dict[str, Any], pages: np.ndarray, row: int) -> list[Any]:
    """``state_indices`` in ``state_types`` order: the DSA pages, then the kpool tail."""
    out: list[Any] = [pages]
    if p.sglang.config.kpool > 1:
        out.append(tail_slots(p, r, row)[0])
    return out


def fill_prefill(p: E.Pools, r: dict[str, Any]) -> None:
    n_pages = math.ceil(r["seq"] / E.PAGE)
    for k in range(n_pages):
        page = r["src"][k]
        for layer, t in enumerate(p.main):
            t[page].copy_(_t(E.page_bytes("main", layer, k, r["room"], t.shape[1])))
        for layer, t in enumerate(p.indexer):
            t[page].copy_(_t(E.page_bytes("indexer", layer, k, r["room"], t.shape[1])))
    for i, t in enumerate(p.aux):
        t[r["aux"][0]].copy_(_t(E.page_bytes("aux", i, 0, r["room"], t.shape[1])))
    _, slots = tail_slots(p, r, r["aux"][0])
    for i, t in enumerate(p.tail):
        for k, slot in enumerate(slots):
            t[r["aux"][0], slot * 256:(slot + 1) * 256].copy_(
                _t(E.page_bytes("tail", i, k, r["room"], 256)))


def _t(a: np.ndarray) -> Any:
    import torch

    return torch.from_numpy(a)


def memcpy_baseline(p: E.Pools, pages: np.ndarray) -> float:
    """Seconds to copy the same pages of every buffer once (best of 3), in this process."""
    import torch

    idx = torch.from_numpy(pages.astype(np.int64))
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for buf in (*p.main, *p.indexer):
            buf.index_select(0, idx)
        best = min(best, time.perf_counter() - t)
    return best


class _ChunkEvent:
    """Stands in for SGLang's CUDA indices_event (query / synchronize)."""

    def __init__(self) -> None:
        self._done = threading.Event()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()

    def complete(self) -> None:
        self._done.set()


def run_prefill(port: int) -> None:
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import (
        DisaggregationMode,
        KVClassType,
        TransferBackend,
        get_kv_class,
    )

    sa = E.server_args("prefill", port)
    p = E.pools()
    mgr = get_kv_class(TransferBackend("kvhandoff"), KVClassType.MANAGER)(
        E.kv_args(p), DisaggregationMode.PREFILL, sa, True)
    sender_cls = get_kv_class(TransferBackend("kvhandoff"), KVClassType.SENDER)
    emit(side="prefill", ready=True, manager=type(mgr).__name__)
    for r in ROOMS:
        seen: list[int] = []
        s = sender_cls(mgr, f"127.0.0.1:{port}", r["room"])
        poll_until(s, lambda st: st != KVPoll.Bootstrapping, seen)
        if r["name"] == "decode_abort":
            poll_until(s, lambda st: st == KVPoll.Failed, seen)
            emit(side="prefill", name=r["name"], seen=seen, failure=failure_text(s))
            continue
        prefix = s.pop_decode_prefix_len()
        n_pages = math.ceil((r["seq"] - prefix) / E.PAGE)
        s.init(n_pages, r["aux"][0])
        if r["name"] == "prefill_abort":
            s.abort()
            poll_until(s, lambda st: st == KVPoll.Failed, seen)
            emit(side="prefill", name=r["name"], seen=seen, failure=failure_text(s))
            continue
        fill_prefill(p, r)
        if r["name"] == "chunks":
            # a forward pass longer than the agents' lease (the test sets KVHANDOFF_LEASE_S):
            # the decode's room, open since its metadata, must not expire meanwhile
            time.sleep(2 * float(os.environ.get("KVHANDOFF_LEASE_S", "0")))
        suffix = np.asarray(r["src"][prefix // E.PAGE:], dtype=np.int32)
        off = 0
        t_last = 0.0
        for i, c in enumerate(r["chunks"]):
            last = i == len(r["chunks"]) - 1
            if r["name"] == "prefill_dies" and last:
                emit(side="prefill", name=r["name"], seen=seen, dying=True)
                os._exit(3)  # the prefill process dies between two chunks
            if r["name"] == "chunks" and last:
                # chunked prefill streams: the earlier chunks' main KV moves before the last
                # send() (bounded wait on the agent room's own byte count)
                want = off * E.MAIN_LAYERS * E.PAGE * E.MAIN_BPT
                kv = s._kv
                end = time.monotonic() + DEADLINE_S
                while kv is not None and kv.stats()["bytes"] < want and time.monotonic() < end:
                    time.sleep(0.01)
                emit(side="prefill", name="streamed", want=want,
                     got=None if kv is None else kv.stats()["bytes"])
            if r["name"] == "bench" and i:
                # bench only: the chunk's forward pass (KVH_BENCH_FORWARD_S per chunk, 0 by
                # default), during which earlier chunks may move
                time.sleep(float(os.environ.get("KVH_BENCH_FORWARD_S", "0")))
            t_last = time.perf_counter()
            # "chunks": each chunk comes with an event (SGLang's indices_event) that completes
            # only after send() returned: a send() that waited on it would never return
            ev = _ChunkEvent() if r["name"] == "chunks" else None
            s.send(suffix[off:off + c],
                   state_indices(p, r, suffix, r["aux"][0]) if last else None,
                   num_kv_tokens=min(c * E.PAGE, r["seq"] - prefix - off * E.PAGE),
                   indices_event=ev)
            if ev is not None:
                ev.complete()
            off += c
            st = int(s.poll())
            if seen[-1] != st:
                seen.append(st)
        final = poll_until(s, lambda st: st in (KVPoll.Success, KVPoll.Failed), seen)
        tail = time.perf_counter() - t_last
        emit(side="prefill", name=r["name"], seen=seen,
             failure=failure_text(s) if final == KVPoll.Failed else None,
             bytes=s.get_transfer_metric().transfer_total_bytes, tail_s=tail,
             page_bytes=sum(int(t.shape[1]) for t in (*p.main, *p.indexer)),
             # per agent room: KV, aux, then the kpool tail
             room_bytes=[h.stats()["bytes"] for h in s._handles],
             memcpy_s=memcpy_baseline(p, suffix) if E.FULL_SIZE else None)
        s.clear()
    mgr.close()


def run_decode(port: int) -> None:
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import (
        DisaggregationMode,
        KVClassType,
        TransferBackend,
        get_kv_class,
    )

    sa = E.server_args("decode", port)
    p = E.pools()
    mgr = get_kv_class(TransferBackend("kvhandoff"), KVClassType.MANAGER)(
        E.kv_args(p), DisaggregationMode.DECODE, sa, True)
    receiver_cls = get_kv_class(TransferBackend("kvhandoff"), KVClassType.RECEIVER)
    addr = f"127.0.0.1:{port}"
    end = time.monotonic() + DEADLINE_S
    while not mgr.try_ensure_parallel_info(addr):  # as decode.py: retried each loop
        if time.monotonic() > end:
            raise SystemExit("prefill never registered")
        time.sleep(0.05)
    emit(side="decode", ready=True, manager=type(mgr).__name__)
    sentinel = 0xAB
    for r in ROOMS:
        seen: list[int] = []
        rcv = receiver_cls(mgr, addr, r["room"])
        seen.append(int(rcv.poll()))
        rcv.init(0)
        poll_until(rcv, lambda st: st != KVPoll.Bootstrapping, seen)
        prefix_pages = r["prefix"] // E.PAGE
        n_pages = math.ceil(r["seq"] / E.PAGE)
        for t in (*p.main, *p.indexer):
            for k in range(n_pages):  # the held prefix, and suffix pages with old content
                t[r["dst"][k]].fill_(sentinel)
        for t in p.tail:
            t[r["aux"][1]].fill_(sentinel)
        suffix = np.asarray(r["dst"][prefix_pages:n_pages], dtype=np.int32)
        rcv.send_metadata(suffix, r["aux"][1], state_indices(p, r, suffix, r["aux"][1]),
                          decode_prefix_len=r["prefix"])
        if r["name"] == "decode_abort":
            rcv.abort()
        final = poll_until(rcv, lambda st: st in (KVPoll.Success, KVPoll.Failed), seen)
        out: dict[str, Any] = {"side": "decode", "name": r["name"], "seen": seen}
        if final == KVPoll.Success:
            bad = []
            for kind, bufs in (("main", p.main), ("indexer", p.indexer)):
                for layer, t in enumerate(bufs):
                    for k in range(n_pages):
                        got = t[r["dst"][k]].numpy()
                        if k < prefix_pages:
                            ok = bool((got == sentinel).all())  # held prefix: untouched
                        else:
                            ok = np.array_equal(got, E.page_bytes(kind, layer, k, r["room"],
                                                                  t.shape[1]))
                        if not ok:
                            bad.append(f"{kind}/{layer}/page{k}")
            for i, t in enumerate(p.aux):
                if not np.array_equal(t[r["aux"][1]].numpy(),
                                      E.page_bytes("aux", i, 0, r["room"], t.shape[1])):
                    bad.append(f"aux{i}")
            _, slots = tail_slots(p, r, r["aux"][1])
            for i, t in enumerate(p.tail):
                row = t[r["aux"][1]].numpy()
                for slot in range(len(row) // 256):
                    got = row[slot * 256:(slot + 1) * 256]
                    want = (E.page_bytes("tail", i, slots.index(slot), r["room"], 256)
                            if slot in slots else np.full(256, sentinel, np.uint8))
                    if not np.array_equal(got, want):
                        bad.append(f"tail{i}/slot{slot}")
            out["bad"] = bad
            out["pages_checked"] = n_pages
            out["tail_slots"] = len(slots)
            rcv.clear()
        else:
            out["failure"] = failure_text(rcv)
        out["routes_cached"] = len(mgr._routes)
        emit(**out)
    mgr.close()


def main() -> None:
    role, port = sys.argv[1], int(sys.argv[2])
    if os.environ.get("KVH_SGLANG_TEST_DEBUG"):
        import logging

        logging.basicConfig(level=logging.INFO, format=f"{role} %(name)s %(message)s")
    E.import_sglang(scheduler_modules=False)
    E.load_plugins()
    (run_prefill if role == "prefill" else run_decode)(port)


if __name__ == "__main__":
    main()
