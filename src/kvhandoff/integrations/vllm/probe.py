"""The vLLM half of the layout probe (issue 26): ask the attention backend's own cache write where
a token lands, before a single request moves.

At `register_kv_caches` the connector calls `probe_layer` for one layer of each region: a
scratch cache of the layer's shape, dtype, device and page order, two pages, never the live
pages; known keys and values (MLA: latent and RoPE key) for chosen token slots of both pages,
written through the layer's own ``impl.do_kv_cache_update`` (the call vLLM's forward makes:
CPU_ATTN's ``cpu_attn_reshape_and_cache`` after its K/V split of the block,
``reshape_and_cache_flash``, ``concat_and_cache_mla`` ...). The scratch pages are then read back
through the `LayoutSpec` that `layout.build_layout` (the code that made the live layout) makes
of them and compared slot by slot, plane by plane (`integrations.layout_probe`). Agreement: a
line for the log ("layout verified against CPU_ATTN ..."). Disagreement: `LayoutProbeError`
naming the backend, the slot, the plane and the layout expected; the connector refuses to start.

A layer the probe cannot reach (no attention layer object in vLLM's forward context, so no
engine write path to call) is refused, not trusted: the connector's documented choice. The probe
can be turned off (``KVHANDOFF_LAYOUT_PROBE=false``); the connector then says so in its log and
its status.
"""

from __future__ import annotations

from typing import Any

from kvhandoff.errors import ConfigError
from kvhandoff.integrations.layout_probe import require_agreement, stray_writes
from kvhandoff.integrations.vllm.backends import Backend
from kvhandoff.integrations.vllm.layout import VllmLayout, build_layout
from kvhandoff.kv_layout import RegionSpec

__all__ = ["probe_layer", "probe_slots", "scratch_like"]

SCRATCH_PAGES = 2


def probe_slots(page_tokens: int) -> list[int]:
    """The token slots written: first, second, middle and last row of page 0, first rows and
    the last row of page 1 (both pages, both ends, and a slot that is not a power of two)."""
    n = page_tokens
    slots = {0, 1, n // 2 + 1, n - 1, n, n + 1, 2 * n - 1}
    return sorted(s for s in slots if 0 <= s < SCRATCH_PAGES * n)


def scratch_like(view: Any, pages: int = SCRATCH_PAGES) -> Any:
    """A zeroed ``[pages, H, N, C]`` tensor on `view`'s device with `view`'s dtype and page
    interior order (one page dense, pages one after another)."""
    import torch

    shape = (pages, *view.shape[1:])
    inner = sorted(range(1, 4), key=lambda d: -view.stride(d))  # outermost first
    strides = [0] * 4
    acc = 1
    for d in reversed(inner):
        strides[d] = acc
        acc *= int(view.shape[d])
    strides[0] = acc
    out = torch.empty_strided(shape, strides, dtype=view.dtype, device=view.device)
    out.zero_()
    return out


def probe_layer(vl: VllmLayout, layer_name: str, view: Any, layer: Any, *, total_kv_heads: int,
                tp_rank: int, tp_size: int, cache_dtype: str = "auto",
                backend: Backend | None = None, input_dtype: Any = None) -> str:
    """Probes `layer_name` of `vl` (see the module docstring) and returns the log line.

    Args:
        vl: the live layout the connector built.
        layer_name: the vLLM layer probed; `view` is its live ``[B, H, N, C]`` view (only its
            shape, dtype, device and strides are used).
        layer: vLLM's attention layer object (``static_forward_context[layer_name]``), whose
            ``impl.do_kv_cache_update`` is the engine's write path.
        total_kv_heads, tp_rank, tp_size: as for `build_layout`.
        cache_dtype: vLLM's cache dtype string.
        backend: the description to check (default: the one `vl` was built with; a test passes
            a wrong one to see it refused).
        input_dtype: the model's dtype (what the layer's write is given); default: the cache's.
            A per-tensor fp8 cache (`Backend.fp8_dtype`) stores each element quantised with the
            layer's scale: the expected bytes are the same quantisation of the input
            (``(x / scale)`` cast to the fp8 dtype), so the probe checks placement and scale.

    Raises:
        LayoutProbeError: the kernel put a (slot, plane) elsewhere than the layout says.
        ConfigError: the layer cannot be probed (no write path).
    """
    import torch

    b = backend or vl.backend
    impl = getattr(layer, "impl", None)
    if impl is None or not hasattr(impl, "do_kv_cache_update"):
        raise ConfigError(
            f"layout probe: {layer_name!r} has no attention layer with a cache write in vLLM's "
            "forward context, so the probe cannot ask the backend where a token lands; the "
            "connector refuses to start rather than trust the layout unchecked "
            "(KVHANDOFF_LAYOUT_PROBE=false starts without the probe)")
    scratch = scratch_like(view)
    n = int(view.shape[2])
    sv = build_layout({layer_name: scratch}, backend=b, block_size=n, kv_dtype=vl.layout.kv_dtype,
                      model=vl.layout.model, total_kv_heads=total_kv_heads, tp_rank=tp_rank,
                      tp_size=tp_size)
    (sreg,) = sv.layout.regions
    lid = sv.layer_ids[layer_name]
    live = next(r for r in vl.layout.regions if lid in r.layer_ids)
    if backend is None and sreg.planes != live.planes:
        raise ConfigError(f"layout probe: the scratch cache of {layer_name!r} does not lay out "
                          f"like the live one ({len(sreg.planes)} vs {len(live.planes)} planes)")
    slots = probe_slots(n)
    idx = torch.tensor(slots, dtype=torch.long, device=scratch.device)
    g = torch.Generator().manual_seed(20260)
    q = _Quant.of(b, cache_dtype, layer, scratch, input_dtype)
    if b.mla:
        expected = _write_mla(impl, layer, scratch, idx, slots, g, cache_dtype, q)
    else:
        expected = _write_gqa(impl, layer, scratch, idx, slots, g, sreg, q)
    if scratch.device.type == "cuda":
        torch.cuda.synchronize(scratch.device)
    require_agreement(_label(b, layer), sv.layout, sreg.name, sv.buffers, expected, layer=lid)
    stray = stray_writes(sv.layout, sreg.name, sv.buffers, expected, layer=lid,
                         pages=SCRATCH_PAGES)
    if stray:
        raise ConfigError(
            f"layout probe against {_label(b, layer)}: the cache write put bytes where the "
            f"layout has none of the probed tokens: runs (buffer, byte, length) {stray}; the "
            "page holds something the connector's layout does not describe")
    return (f"layout verified against {_label(b, layer)}: {len(slots)} token slots x "
            f"{len(sreg.planes)} planes on 2 scratch pages of {n} tokens ({sv.order} pages; "
            f"{b.token_layout(sv.order)})")


def _label(b: Backend, layer: Any) -> str:
    isa = getattr(layer, "isa", None)
    return f"{b.name} (ISA {isa})" if b.k_columns and isa else b.name


def _rand(shape: tuple[int, ...], g: Any, dtype: Any, device: Any) -> Any:
    import torch

    return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype).to(device)


def _bytes(t: Any) -> bytes:
    import torch

    out: bytes = t.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy().tobytes()
    return out


class _Quant:
    """What the cache stores of an input element: the element itself, or (per-tensor fp8) the
    element divided by the layer's scale, cast to the fp8 dtype."""

    def __init__(self, dtype: Any, fp8: Any, k_scale: float, v_scale: float) -> None:
        self.dtype = dtype  # the input's dtype
        self.fp8 = fp8  # the stored torch fp8 dtype, or None
        self.k_scale, self.v_scale = k_scale, v_scale

    @classmethod
    def of(cls, b: Backend, cache_dtype: str, layer: Any, scratch: Any,
           input_dtype: Any) -> _Quant:
        import torch

        name = b.fp8_dtype(cache_dtype)
        if name is None:
            return cls(scratch.dtype, None, 1.0, 1.0)  # rows in the input's own dtype
        k = float(getattr(layer, "_k_scale_float", 1.0))
        v = float(getattr(layer, "_v_scale_float", k))
        dt = input_dtype if isinstance(input_dtype, torch.dtype) else torch.bfloat16
        return cls(dt, getattr(torch, name), k, v)

    def stored(self, x: Any, value: bool = False) -> Any:
        if self.fp8 is None:
            return x
        scale = self.v_scale if value else self.k_scale
        return (x.float() / scale).to(self.fp8)


def _write_gqa(impl: Any, layer: Any, scratch: Any, idx: Any, slots: list[int], g: Any,
               reg: RegionSpec, q: _Quant) -> dict[tuple[int, str], bytes]:
    """Keys and values of every local head through the layer's cache write; per (slot, plane)
    what the cache should hold of them (`q`), in the plane order `reg` claims."""
    import torch

    _, h, _, c = (int(s) for s in scratch.shape)
    d = c // 2
    key = _rand((len(slots), h, d), g, q.dtype, scratch.device)
    value = _rand((len(slots), h, d), g, q.dtype, scratch.device)
    impl.do_kv_cache_update(layer, key, value, scratch, idx)
    key, value = q.stored(key), q.stored(value, value=True)
    names = [p.name for p in reg.planes]
    expected: dict[tuple[int, str], bytes] = {}
    for t, s in enumerate(slots):
        if names == ["kv"]:  # token-major page: every local head's K|V in one row
            expected[(s, "kv")] = _bytes(torch.cat([key[t], value[t]], dim=-1))
            continue
        for j, hn in enumerate(_head_names(names)):
            if f"{hn}.v" in names:  # K column-major: one plane per element of K, then V
                for i in range(d):
                    expected[(s, f"{hn}.k{i}")] = _bytes(key[t, j, i])
                expected[(s, f"{hn}.v")] = _bytes(value[t, j])
            else:
                expected[(s, hn)] = _bytes(torch.cat([key[t, j], value[t, j]]))
    return expected


def _head_names(names: list[str]) -> list[str]:
    """The head plane prefixes (``h<g>``) in page order."""
    out: list[str] = []
    for nm in names:
        head = nm.split(".")[0]
        if head not in out:
            out.append(head)
    return out


def _write_mla(impl: Any, layer: Any, scratch: Any, idx: Any, slots: list[int], g: Any,
               cache_dtype: str, q: _Quant) -> dict[tuple[int, str], bytes]:
    """Latent and RoPE key through the layer's cache write (on vLLM's ``[B, N, C]`` view)."""
    import torch

    c = int(scratch.shape[-1])
    rank = int(getattr(impl, "kv_lora_rank", 0) or c - 64)
    kv_c = _rand((len(slots), rank), g, q.dtype, scratch.device)
    k_pe = _rand((len(slots), 1, c - rank), g, q.dtype, scratch.device)
    k_scale = getattr(layer, "_k_scale", None)
    if k_scale is None:
        k_scale = torch.full((), q.k_scale, dtype=torch.float32, device=scratch.device)
    impl.do_kv_cache_update(kv_c, k_pe, scratch.squeeze(1), idx, cache_dtype, k_scale)
    kv_c, k_pe = q.stored(kv_c), q.stored(k_pe)
    return {(s, "latent"): _bytes(torch.cat([kv_c[t], k_pe[t, 0]]))
            for t, s in enumerate(slots)}
