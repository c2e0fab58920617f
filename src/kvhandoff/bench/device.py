"""The device bench (`kvhandoff bench --device cuda`): the page set of the CPU bench, with both
sides' buffers on one GPU, in one process.

No agent transport moves device memory yet (tcp and ucx refuse CUDA buffers; the shm
transport's CUDA IPC lane exists as pieces in `transfer/transports/_cuda_ipc.py`), so the
handoff cases of the CPU bench do not run here. What runs, alternating per repetition:

- contiguous: one device copy of as many bytes as the page set holds: the memory's ceiling.
- limit: the page set copied with one gather/scatter kernel per (layer, region) through a
  byte index built beforehand (the same index for every layer of a region): the baseline a
  device lane cannot beat by much.
- lane: the page set copied by `_cuda_ipc.copy_spans` per (layer, region) (span matching,
  batching, private stream, event), in one process: the copy engine of the same-host lane
  without the IPC mapping.
- devsum: the device checksum of every (layer, region) source stream (one side's cost).

Every copy case is verified after its last repetition: per (layer, region) the device
checksum of the destination spans equals the source's, and the streams are byte-equal.
`device="cpu"` runs the same code on CPU tensors (tests; figures meaningless).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvhandoff.bench.pageset import PageSet, layers_of, rank_spec

DEVICE_CASES = ("contiguous", "limit", "lane", "devsum")
NOT_RUN = ("handoff cases not run on a device: no agent transport moves device memory yet "
           "(tcp/ucx refuse CUDA buffers; the shm CUDA IPC lane is not wired); see docs/GPU.md")


class NoCudaDevice(Exception):
    """`--device cuda` on a machine (or torch build) without CUDA."""


def cuda_preflight(device: str) -> Any:
    """The torch device for `device` ("cuda" or "cuda:N"); `NoCudaDevice` whose message starts
    "no CUDA device: " saying why there is none; ValueError for another device name."""
    if device != "cuda" and not device.startswith("cuda:"):
        raise ValueError(f"device: expected cpu, cuda or cuda:N, got {device!r}")
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        raise NoCudaDevice("no CUDA device: torch is not installed") from None
    if torch.version.cuda is None:
        raise NoCudaDevice(f"no CUDA device: torch {torch.__version__} is a CPU-only build "
                           "(install a CUDA build of torch)")
    if not torch.cuda.is_available():
        raise NoCudaDevice(f"no CUDA device: torch {torch.__version__} (CUDA "
                           f"{torch.version.cuda}) sees none (no GPU, no driver, or "
                           "CUDA_VISIBLE_DEVICES hides them)")
    dev = torch.device(device)
    n = torch.cuda.device_count()
    if dev.index is not None and dev.index >= n:
        raise NoCudaDevice(f"no CUDA device: {device} asked, {n} visible")
    return dev


def _sync(dev: Any) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _byte_index(off: np.ndarray, nb: np.ndarray, dev: Any, w: int = 1) -> Any:
    """The index of every `w`-byte word of the stream of spans (off, nb) in the buffer."""
    import torch

    off, nb = off // w, nb // w
    idx = np.repeat(off - np.concatenate([[0], np.cumsum(nb)[:-1]]), nb) + np.arange(nb.sum())
    return torch.as_tensor(idx.astype(np.int64), device=dev)


def run_device_bench(*, device: str = "cuda", model: str = "glm-5.3", context: int = 16_384,
                     prefix: int = 4_096, page_size: int | None = None,
                     prefill_page: int | None = None, decode_page: int | None = None,
                     reps: int = 5, warmup: int = 1, slack: float = 1.25, seed: int = 0,
                     progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Runs the device bench (module doc) and returns its result object."""
    import torch

    from kvhandoff.bench.runner import summarise
    from kvhandoff.buffers.devsum import devsum
    from kvhandoff.transports.shm.cuda_ipc import as_words, copy_spans, word_size

    dev = torch.device(device) if device == "cpu" else cuda_preflight(device)
    say = progress or (lambda s: None)
    p_page, d_page = prefill_page or page_size, decode_page or page_size
    src_spec, spec = rank_spec(model, p_page), rank_spec(model, d_page)
    ps = PageSet.random(seq_len=context, prefix=prefix, src_page_size=src_spec.page_size_tokens,
                        dst_page_size=spec.page_size_tokens, slack=slack, seed=seed)
    plans = ps.plans(src_spec, spec)
    gen = torch.Generator(device=dev)
    gen.manual_seed(seed)
    say("allocating buffers")
    work: list[tuple[str, int, Any, Any, Any]] = []  # (region, layer, src, dst, plan)
    for lid in layers_of(spec):
        for reg in spec.regions_of_layer(lid):
            s_size = src_spec.region(reg.name).page_nbytes(ps.src_page_size) * ps.src_num_pages
            d_size = reg.page_nbytes(ps.dst_page_size) * ps.dst_num_pages
            src = torch.randint(0, 256, (s_size,), dtype=torch.uint8, device=dev,
                                generator=gen)
            work.append((reg.name, lid, src, torch.zeros(d_size, dtype=torch.uint8,
                                                         device=dev), plans[reg.name]))
    total = sum(int(p.nbytes.sum()) for *_, p in work)
    # the limit's index: per region (the same for every layer), in the widest word the
    # spans allow (torch's allocations are 512-byte aligned)
    words = {name: word_size((), p.src_offsets, p.dst_offsets, p.nbytes)
             for name, p in plans.items()}
    index = {name: (_byte_index(p.src_offsets, p.nbytes, dev, words[name]),
                    _byte_index(p.dst_offsets, p.nbytes, dev, words[name]))
             for name, p in plans.items()}
    flat_src = torch.randint(0, 256, (total,), dtype=torch.uint8, device=dev, generator=gen)
    flat_dst = torch.empty_like(flat_src)

    def contiguous() -> None:
        flat_dst.copy_(flat_src)

    def limit() -> None:
        for name, _, src, dst, _ in work:
            si, di = index[name]
            w = words[name]
            as_words(dst, w).index_copy_(0, di, torch.index_select(as_words(src, w), 0, si))

    def lane() -> None:
        done = None
        for _, _, src, dst, p in work:
            done = copy_spans(src, dst, p)
        if done is not None:
            done.synchronize()  # one private stream: the last event is behind every copy

    def checksums() -> None:
        for _, _, src, _, p in work:
            devsum(src, p.src_offsets, p.nbytes)

    fns = {"contiguous": contiguous, "limit": limit, "lane": lane, "devsum": checksums}
    times: dict[str, list[float]] = {c: [] for c in DEVICE_CASES}
    verified: dict[str, bool] = {}
    for rep in range(warmup + reps):
        order = DEVICE_CASES[rep % 4:] + DEVICE_CASES[:rep % 4]  # no case always follows one
        for case in order:
            say(f"{case} (repetition {rep + 1}/{warmup + reps})")
            if case in ("limit", "lane"):
                for _, _, _, dst, _ in work:
                    dst.zero_()
            _sync(dev)
            t0 = time.perf_counter()
            fns[case]()
            _sync(dev)
            dt = time.perf_counter() - t0
            if rep >= warmup:
                times[case].append(dt)
            if case in ("limit", "lane") and rep == warmup + reps - 1:
                verified[case] = _verify(work, devsum)
    verified["contiguous"] = bool(torch.equal(flat_src, flat_dst))
    cases = {c: {**summarise(v), "GBps_median": total / summarise(v)["median_s"] / 1e9,
                 "GBps_best": total / min(v) / 1e9} for c, v in times.items() if v}

    def ratio(a: str, b: str) -> float | None:
        if a not in cases or b not in cases:
            return None
        return float(cases[a]["median_s"] / cases[b]["median_s"])

    return {
        "device": str(dev), "device_name": (torch.cuda.get_device_name(dev)
                                            if dev.type == "cuda" else "cpu"),
        "workload": {"model": model, "context_tokens": context, "prefix_tokens": ps.prefix,
                     "prefill_page_tokens": ps.src_page_size,
                     "decode_page_tokens": ps.dst_page_size, "bytes": total,
                     "pieces": sum(int(p.count) for *_, p in work),
                     "layer_region_pairs": len(work)},
        "config": {"reps": reps, "warmup": warmup, "seed": seed, "slack": slack},
        "cases": cases,
        "ratios": {"lane_time_over_limit": ratio("lane", "limit"),
                   "limit_time_over_contiguous": ratio("limit", "contiguous"),
                   "devsum_time_over_lane_copy": ratio("devsum", "lane"),
                   "devsum_time_over_limit_copy": ratio("devsum", "limit")},
        "verified": verified,
        "not_run": NOT_RUN,
    }


def _verify(work: list[tuple[str, int, Any, Any, Any]], devsum: Any) -> bool:
    """Per (layer, region): equal device checksums and byte-equal streams on both sides."""
    import torch

    for _, _, src, dst, p in work:
        if devsum(src, p.src_offsets, p.nbytes) != devsum(dst, p.dst_offsets, p.nbytes):
            return False
        si = _byte_index(p.src_offsets, p.nbytes, src.device)
        di = _byte_index(p.dst_offsets, p.nbytes, dst.device)
        if not torch.equal(torch.index_select(src, 0, si), torch.index_select(dst, 0, di)):
            return False
    return True


def print_device_summary(r: dict[str, Any], con: Any) -> None:
    """The device bench's tables (rich)."""
    from rich.table import Table

    w = r["workload"]
    pages = (f", pages {w['prefill_page_tokens']} -> {w['decode_page_tokens']} tokens"
             if w["prefill_page_tokens"] != w["decode_page_tokens"] else "")
    t = Table(title=f"kvhandoff bench on {r['device']} ({r['device_name']}): {w['model']}, "
              f"{w['context_tokens']:,} tokens ({w['prefix_tokens']:,} cached), "
              f"{w['bytes'] / 1e6:,.1f} MB in {w['pieces']:,} pieces{pages}, "
              f"{r['config']['reps']} reps")
    for col in ("case", "median", "GB/s (median)", "GB/s (best)", "spread (max-min)/med"):
        t.add_column(col, justify="left" if col == "case" else "right")
    labels = {"contiguous": "device copy, 1 contiguous buffer (ceiling)",
              "limit": "device gather/scatter of the page set (limit baseline)",
              "lane": "CUDA IPC lane copy engine (copy_spans, 1 process)",
              "devsum": "device checksum of the page set (one side)"}
    for case, s in r["cases"].items():
        t.add_row(labels.get(case, case), f"{s['median_s'] * 1e3:,.3f} ms",
                  f"{s['GBps_median']:.1f}", f"{s['GBps_best']:.1f}", f"{s['spread_pct']:.1f} %")
    con.print(t)
    for k, v in r["ratios"].items():
        if v is not None:
            con.print(f"{k}: {v:.3f}")
    con.print("verified byte-exact: " + ", ".join(f"{k}={v}" for k, v in r["verified"].items()))
    con.print(r["not_run"])
