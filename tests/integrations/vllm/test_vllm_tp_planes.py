"""Heterogeneous TP on vLLM layouts (issue 21): a rank holding one KV head and a rank holding
all of them name their planes alike, so a TP-2 prefill pairs with a TP-1 decode and the
reverse. Layouts come from vLLM's own planner and allocator (per-layer ``[B, H, N, C]`` views of
the ranks' head counts) through `build_layout`; the rooms run between real agents over the
in-process transport (tests/hetero's harness): every decode rank byte-exact, per head.

Main refused this at the handshake: ``kv.planes: prefill=['head'] decode=['h0', 'h1']`` (a TP-1
rank's region was replicated, a TP-2 rank's head-sharded).
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm is installed by `make setup` (requirements/engines-*)")

import torch  # noqa: E402
import vllm_env as env  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

from kvhandoff.integrations.vllm.backends import BACKENDS  # noqa: E402
from kvhandoff.integrations.vllm.layout import build_layout  # noqa: E402
from kvhandoff.kv_layout import LayoutSpec, TPSplit, layout_compat_diff  # noqa: E402
from kvhandoff.state_machine import KVPoll  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "hetero"))
from hetkit import close_all, handoff, make_ranks  # noqa: E402

try:
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
except ImportError:  # vLLM 0.32
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups

HEADS, HEAD, BLOCK = 2, 32, 32
ROOMS = itertools.count(9100)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return env.model_dir(tmp_path_factory.mktemp("model"))


def rank_layouts(model: Path, backend: str, tp: int, kv_layout: str = "LBHNC"
                 ) -> list[LayoutSpec]:
    """The layouts of the `tp` ranks of one engine, each from vLLM's views of its heads."""
    cfg = env.vllm_config(model, role="kv_consumer", engine_id="x", layout=kv_layout)
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS // tp, head_size=HEAD,
                             dtype=torch.float32)
    kcc = get_kv_cache_config_from_groups(cfg, [KVCacheGroupSpec(env.layer_names(), spec)],
                                          8 * spec.page_size_bytes * env.NUM_LAYERS)
    out = []
    for r in range(tp):
        kv = allocate_kv_cache(kcc, torch.device("cpu"),
                               cfg.cache_config.get_resolved_kv_cache_layout())
        out.append(build_layout(kv, backend=BACKENDS[backend], block_size=BLOCK,
                                kv_dtype="auto:float32", model="m", total_kv_heads=HEADS,
                                tp_rank=r, tp_size=tp).layout)
    return out


@pytest.mark.parametrize("backend", ["CPU_ATTN", "FLASH_ATTN"])
def test_plane_names_agree_across_tp(model: Path, backend: str) -> None:
    tp2, (tp1,) = rank_layouts(model, backend, 2), rank_layouts(model, backend, 1)
    heads = [{p.name.split(".")[0] for p in lay.regions[0].planes} for lay in (*tp2, tp1)]
    assert heads == [{"h0"}, {"h1"}, {"h0", "h1"}]
    for lay, n in ((tp2[0], 1), (tp2[1], 1), (tp1, 2)):
        (reg,) = lay.regions
        assert (reg.tp_split, reg.num_heads, reg.whole_pages) == (TPSplit.HEAD_SHARDED, n, True)
    for p in tp2:
        assert layout_compat_diff(p, tp1) == [] and layout_compat_diff(tp1, p) == []


@pytest.mark.parametrize(("backend", "prefill_tp", "decode_tp"), [
    ("CPU_ATTN", 2, 1), ("CPU_ATTN", 1, 2), ("FLASH_ATTN", 2, 1)])
def test_rooms_cross_tp_sizes_byte_exact(model: Path, backend: str, prefill_tp: int,
                                         decode_tp: int) -> None:
    pre = make_ranks("prefill", rank_layouts(model, backend, prefill_tp), num_pages=8)
    dec = make_ranks("decode", rank_layouts(model, backend, decode_tp), num_pages=8, seed=3)
    try:
        out = handoff(pre, dec, next(ROOMS), seq_len=40)  # the second page holds 8 tokens
        assert out.decode_states == [KVPoll.Success] * decode_tp, out.failures
        assert out.bad == [0] * decode_tp and out.released and out.pools_full
        if prefill_tp > decode_tp:  # the one decode rank reads each head from its rank
            assert out.peers[0] == [r.agent.address for r in pre]
    finally:
        close_all(pre + dec)


def test_token_major_pages_cannot_change_tp(model: Path) -> None:
    """NHD pages hold every local head in one row per token: a head is no plane, so another TP
    size cannot take its heads; the handshake refuses, naming the plane sizes."""
    tp2, (tp1,) = (rank_layouts(model, "FLASH_ATTN", 2, "LBNHC"),
                   rank_layouts(model, "FLASH_ATTN", 1, "LBNHC"))
    diff: list[Any] = layout_compat_diff(tp2[0], tp1)
    assert diff and all("bytes_per_token" in d for d in diff), diff
