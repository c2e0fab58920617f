"""`kvhandoff demo --device cuda`: one handoff's page set with both sides' KV buffers on a GPU.

What runs (one process; no agent, no bootstrap server): the agents' device lane is the shm
transport's CUDA IPC lane, which needs the two agents in two processes (CUDA IPC does not
open a handle in the process that exported it; tests/unit/gpu/test_shm_cuda_handoff.py runs
two agents that way), so this one-process demo drives the lane's pieces
(`transfer/transports/_cuda_ipc.py`) directly and says so (`degraded`, `transport_reason`):

- prefill and decode `BufferSet`s on the device (`allocate(..., device=)`), page tables drawn
  at random from fragmented pools (the bench's `PageSet`), span plans as the agents build
  them (prefill and decode page sizes may differ);
- the prefill "computes" each layer (random bytes written by a device kernel), records a
  CUDA event and marks the layer ready through the agent's `EventWaiter`: the marking never
  blocks; the waiter copies the layer once its event completed (`copy_spans` on a private
  stream) and verifies it with the device checksum on both sides;
- at the end every (layer, region) stream is compared byte for byte and the decode bytes
  outside the planned spans (its cached prefix, free pages) must be untouched.

`device="cpu"` runs the same code on CPU tensors (tests only).
"""

from __future__ import annotations

import threading
import time
from typing import Any

REASON = ("no agent: the agents' device lane (shm over CUDA IPC) needs two processes and this "
          "demo is one, so the CUDA IPC lane pieces run here directly; two agents over it: "
          "tests/unit/gpu/test_shm_cuda_handoff.py; see docs/GPU.md")


class _Room:
    room, done = 1, False


def _t(view: Any) -> Any:
    """A BufferSet view as a torch tensor (host views are numpy arrays: no copy)."""
    import torch

    return view if isinstance(view, torch.Tensor) else torch.from_numpy(view)


def run_demo_device(*, device: str = "cuda", model: str = "glm-5.3", context: int = 16_384,
                    prefix: int = 4_096, page_size: int | None = None,
                    prefill_page: int | None = None, decode_page: int | None = None,
                    timeout_s: float = 120.0, seed: int = 0) -> dict[str, Any]:
    """Runs the device demo (module doc) and returns its summary."""
    import torch

    from kvhandoff.bench.device import _byte_index, cuda_preflight
    from kvhandoff.bench.pageset import PageSet, layers_of, rank_spec
    from kvhandoff.buffers.bufferset import BufferSet, allocate
    from kvhandoff.buffers.devsum import devsum
    from kvhandoff.protocol import events as ev
    from kvhandoff.runtime.eventwait import EventWaiter
    from kvhandoff.transports.shm.cuda_ipc import copy_spans

    dev = torch.device("cpu") if device == "cpu" else cuda_preflight(device)
    t_start = time.monotonic()
    p_page, d_page = prefill_page or page_size, decode_page or page_size
    src_spec, spec = rank_spec(model, p_page), rank_spec(model, d_page)
    ps = PageSet.random(seq_len=context, prefix=prefix, src_page_size=src_spec.page_size_tokens,
                        dst_page_size=spec.page_size_tokens, seed=seed)
    plans = ps.plans(src_spec, spec)
    src = BufferSet(src_spec, allocate(src_spec, ps.src_num_pages, device=str(dev)))
    dst = BufferSet(spec, allocate(spec, ps.dst_num_pages, device=str(dev)))
    layers = layers_of(spec)
    gen = torch.Generator(device=dev)
    gen.manual_seed(seed)

    cond = threading.Condition()
    landed: dict[int, float] = {}
    bad: list[str] = []
    verified = [0]

    def on_ready(e: Any) -> None:  # the waiter thread: the layer's kernels have finished
        try:
            done = None
            pairs = []
            for reg in spec.regions_of_layer(e.layer):
                p = plans[reg.name]
                s, d = _t(src.array(reg.name, e.layer)), _t(dst.array(reg.name, e.layer))
                done = copy_spans(s, d, p)
                pairs.append((reg.name, s, d, p))
            if done is not None:
                done.synchronize()
            for name, s, d, p in pairs:
                if devsum(s, p.src_offsets, p.nbytes) != devsum(d, p.dst_offsets, p.nbytes):
                    bad.append(f"layer {e.layer} region {name}: device checksums differ")
                verified[0] += 1
        except Exception as err:  # noqa: BLE001  (reported in the summary, never lost)
            bad.append(f"layer {e.layer}: {type(err).__name__}: {err}")
        with cond:
            landed[e.layer] = time.monotonic()
            cond.notify_all()

    stop = threading.Event()
    waiter = EventWaiter(on_ready, closed=stop.is_set, name="kvh-demo-events")
    view = _Room()
    t_first = t_last_ready = None
    try:
        for lid in layers:
            for reg in src_spec.regions_of_layer(lid):
                buf = _t(src.array(reg.name, lid))
                buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, device=dev,
                                        generator=gen))  # the layer's "compute"
            event: Any = None
            if dev.type == "cuda":
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record()
            t_last_ready = time.monotonic()
            t_first = t_first or t_last_ready
            waiter.submit(view, event, ev.LayerReady(view.room, view, lid), layer=lid)
        with cond:
            all_in = cond.wait_for(lambda: len(landed) == len(layers), timeout_s)
    finally:
        stop.set()
    t_success = max(landed.values()) if landed and all_in else None
    byte_exact, touched = _check(src, dst, spec, plans, layers, dev, _byte_index)
    total = sum(int(plans[r.name].nbytes.sum()) for lid in layers
                for r in spec.regions_of_layer(lid))
    per_region = {r.name: int(plans[r.name].nbytes.sum()) * len(r.live_layer_ids)
                  for r in spec.regions}
    window = (t_success - t_first) if t_success and t_first else None
    ok = bool(all_in and not bad and byte_exact and touched == 0)
    state = "Success" if ok else "Failed"
    return {
        "ok": ok, "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "model": model, "context_tokens": context, "prefix_tokens": ps.prefix,
        "page_size_tokens": spec.page_size_tokens,
        "prefill_page_tokens": ps.src_page_size, "decode_page_tokens": ps.dst_page_size,
        "layers": len(layers), "transport": "cuda_ipc pieces (in process)",
        "lanes": ["copy_spans on a private stream"], "degraded": True,
        "transport_reason": REASON, "agent": False,
        "state": {"prefill": state, "decode": state},
        "failure": "; ".join(bad[:5]) or (None if all_in else
                                         f"not every layer landed within {timeout_s:g}s"),
        "bytes": total, "bytes_per_region": per_region,
        "descriptors_after": {r.name: int(plans[r.name].count) * len(r.live_layer_ids)
                              for r in spec.regions},
        "checksums_verified": verified[0], "checksum": "device (devsum)",
        "verify": {"byte_exact": byte_exact, "prefix_touched_bytes": touched},
        "byte_exact": byte_exact,
        "handoff_window_s": window, "gbps_window": total / window / 1e9 if window else None,
        "tail_s": (t_success - t_last_ready) if t_success and t_last_ready else None,
        "wall_s": time.monotonic() - t_start,
    }


def _check(src: Any, dst: Any, spec: Any, plans: dict[str, Any], layers: list[int], dev: Any,
           byte_index: Any) -> tuple[bool, int]:
    """(every (layer, region) stream byte-equal, decode bytes written outside the plans)."""
    import torch

    exact, touched = True, 0
    masks: dict[str, Any] = {}
    for lid in layers:
        for reg in spec.regions_of_layer(lid):
            p = plans[reg.name]
            s, d = _t(src.array(reg.name, lid)), _t(dst.array(reg.name, lid))
            si = byte_index(p.src_offsets, p.nbytes, dev)
            di = byte_index(p.dst_offsets, p.nbytes, dev)
            exact &= bool(torch.equal(torch.index_select(s, 0, si),
                                      torch.index_select(d, 0, di)))
            if reg.name not in masks:
                m = torch.ones(d.numel(), dtype=torch.bool, device=dev)
                m[di] = False
                masks[reg.name] = m
            touched += int(torch.count_nonzero(d[masks[reg.name]]))
    return exact, touched


def print_summary(r: dict[str, Any], con: Any) -> None:
    from rich.table import Table

    t = Table(title=f"kvhandoff demo on {r['device']} ({r['device_name']}): {r['model']}, "
              f"{r['context_tokens']:,} tokens, {r['prefix_tokens']:,} cached on decode, "
              f"pages {r['prefill_page_tokens']} -> {r['decode_page_tokens']}, "
              f"{r['layers']} layers")
    t.add_column("what")
    t.add_column("value", justify="right")
    for name, n in r["bytes_per_region"].items():
        t.add_row(f"bytes {name}", f"{n:,} B ({n / 1e6:,.1f} MB)")
    t.add_row("bytes moved (device to device)", f"{r['bytes']:,} B")
    for name, n in r["descriptors_after"].items():
        t.add_row(f"copy pieces {name} (all layers)", f"{n:,}")
    if r["handoff_window_s"]:
        t.add_row("first layer_ready -> last layer verified",
                  f"{r['handoff_window_s'] * 1e3:,.2f} ms ({r['gbps_window']:.2f} GB/s)")
    if r["tail_s"] is not None:
        t.add_row("tail: last layer_ready -> verified", f"{r['tail_s'] * 1e3:,.2f} ms")
    t.add_row("device checksums verified (layer x region)", str(r["checksums_verified"]))
    t.add_row("byte-exact", f"{'yes' if r['byte_exact'] else 'NO'} "
              f"({r['verify']['prefix_touched_bytes']} bytes touched outside the plan)")
    t.add_row("transport", f"{r['transport']} (DEGRADED)")
    t.add_row("result", "[green]OK[/green]" if r["ok"] else f"[red]FAILED[/red] {r['failure']}")
    con.print(t)
    con.print(r["transport_reason"])
