"""What a registrant can cost the bootstrap server, over real HTTP (issue 48): registrations
bounded by what a real engine can be, engines that leave with their last rank, `/ready` and
`/metrics` whose size does not grow with the ranks registered, paged listings, and a typed
``PUT /route``. `HOSTILE` is the bootstrap's hostile list: each entry is refused with the
status and the field it names, and leaves nothing behind."""

from __future__ import annotations

import ast
import importlib.util
import types
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvhandoff.kv_layout import layout_hash, preset
from kvhandoff.testing.clock import FakeClock

GLM = preset("glm-5.3")
Server = Callable[..., str]
# the whole /ready answer stays under this whatever is registered (it lists at most 16 items
# of each kind; a world-1024 engine with one live rank used to list 1,023 missing ranks)
READY_MAX_BYTES = 8192


def rank_body(engine: str = "p", *, dp: int = 0, tp: int = 0, dp_size: int = 1,
              tp_size: int = 2, gen: str = "g1", transport: str = "inproc") -> dict[str, Any]:
    return {"engine_id": engine, "role": "prefill", "dp_rank": dp, "dp_size": dp_size,
            "tp_rank": tp, "tp_size": tp_size, "agent_address": f"127.0.0.1:{6000 + tp}",
            "generation": gen, "layout": GLM.to_dict(), "layout_hash": layout_hash(GLM),
            "transport": transport}


def sglang_put(**over: Any) -> dict[str, Any]:
    body = {"attn_tp_size": 1, "attn_tp_rank": 0, "attn_cp_size": 1, "attn_cp_rank": 0,
            "attn_dp_size": 1, "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0,
            "system_dp_size": 1, "system_dp_rank": 0, "rank_ip": "127.0.0.1",
            "rank_port": 17000, "page_size": 64, "kv_cache_dtype": "auto"}
    body.update(over)
    return body


def metric(url: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def nested(depth: int) -> dict[str, Any]:
    out: dict[str, Any] = {"x": 1}
    for _ in range(depth):
        out = {"x": out}
    return out


# (name, method, path, body, status, words the error detail must name)
HOSTILE: list[tuple[str, str, str, dict[str, Any], int, tuple[str, ...]]] = [
    ("ghost_world_65536", "POST", "/v1/ranks",
     rank_body("ghost", dp_size=256, tp_size=256), 400, ("max_world_size=1024", "65536")),
    ("ghost_world_1025_cp", "POST", "/v1/ranks",
     {**rank_body("ghost", tp_size=1), "cp_size": 1025}, 400, ("max_world_size=1024",)),
    ("sglang_ghost_world", "PUT", "/route",
     sglang_put(attn_dp_size=256, attn_tp_size=256), 400, ("max_world_size=1024", "65536")),
    ("dsv41_wrong_type", "PUT", "/route",
     sglang_put(dsv41_spec_layout={"num_draft_tokens": "four"}), 422,
     ("dsv41_spec_layout.num_draft_tokens",)),
    ("dsv41_unknown_field", "PUT", "/route",
     sglang_put(dsv41_spec_layout={"num_draft_tokens": 4, "blob": "x" * 1000}), 422,
     ("dsv41_spec_layout.blob",)),
    ("dsv41_too_many_layers", "PUT", "/route",
     sglang_put(dsv41_spec_layout={"kv_layer_ids": list(range(5000))}), 422,
     ("dsv41_spec_layout.kv_layer_ids",)),
    ("dsv41_negative_len", "PUT", "/route",
     sglang_put(dsv41_spec_layout={"state_item_lens": [[64], [-1]]}), 422,
     ("dsv41_spec_layout.state_item_lens",)),
    ("dsv41_deep_nesting", "PUT", "/route",
     sglang_put(dsv41_spec_layout=nested(200)), 422, ("dsv41_spec_layout",)),
    ("dsv41_not_an_object", "PUT", "/route",
     sglang_put(dsv41_spec_layout=[1, 2, 3]), 422, ("dsv41_spec_layout",)),
    ("kv_layout_junk_object", "PUT", "/route",
     sglang_put(kv_layout={"a": list(range(1000))}), 422, ("kv_layout", "regions")),
    ("kv_layout_bad_region", "PUT", "/route",
     sglang_put(kv_layout={"regions": [{"name": 1}]}), 422, ("kv_layout",)),
    ("ranks_page_too_big", "GET", "/v1/ranks?limit=1000000", {}, 422, ("limit",)),
    ("engines_page_negative", "GET", "/v1/engines?offset=-1", {}, 422, ("offset",)),
]


@pytest.mark.parametrize(("method", "path", "body", "status", "names"),
                         [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
def test_hostile_bootstrap_writes_are_refused_naming_the_field(
        bootstrap_server: Server, method: str, path: str, body: dict[str, Any], status: int,
        names: tuple[str, ...]) -> None:
    url = bootstrap_server()
    r = httpx.request(method, url + path, **({"json": body} if method != "GET" else {}))
    assert r.status_code == status, r.text
    for word in names:
        assert word in r.json()["detail"], (word, r.text)
    ready = httpx.get(url + "/ready").json()
    assert ready["engine_count"] == 0 and ready["expected_ranks"] == 0
    assert ready["reason"] == "no rank has registered yet"


def test_six_ghost_engines_leave_ready_small_and_counted(bootstrap_server: Server) -> None:
    url = bootstrap_server()
    for i in range(6):
        r = httpx.post(url + "/v1/ranks", json=rank_body(f"ghost{i}", dp_size=256, tp_size=256))
        assert r.status_code == 400, r.text
    assert metric(url, "kvhandoff_bootstrap_registrations_refused_total") == 6
    # the biggest engine the bound lets in: one rank of a world of 1,024
    r = httpx.post(url + "/v1/ranks", json=rank_body("big", dp_size=32, tp_size=32))
    assert r.status_code == 200, r.text
    ready = httpx.get(url + "/ready")
    assert ready.status_code == 503 and len(ready.content) < READY_MAX_BYTES
    body = ready.json()
    assert body["missing_ranks"] == 1023 and body["expected_ranks"] == 1024
    assert len(body["missing"]) == 16 and body["missing"][0]["tp_rank"] == 1
    assert metric(url, "kvhandoff_bootstrap_ranks_missing") == 1023


def test_engines_and_ranks_past_their_bounds_get_409(bootstrap_server: Server) -> None:
    url = bootstrap_server(max_engines=3, max_live_ranks=5)
    for e in ("e0", "e1", "e2"):
        httpx.post(url + "/v1/ranks", json=rank_body(e)).raise_for_status()
    r = httpx.post(url + "/v1/ranks", json=rank_body("e3"))
    assert r.status_code == 409
    assert "engine_id" in r.json()["detail"] and "max_engines=3" in r.json()["detail"]
    for e in ("e0", "e1"):
        httpx.post(url + "/v1/ranks", json=rank_body(e, tp=1)).raise_for_status()
    r = httpx.post(url + "/v1/ranks", json=rank_body("e2", tp=1))
    assert r.status_code == 409 and "max_live_ranks=5" in r.json()["detail"]
    # a known identity may always register again (a restarted rank), bounds or not
    again = httpx.post(url + "/v1/ranks", json=rank_body("e0", gen="g2"))
    assert again.status_code == 200 and again.json()["replaced"] is True
    assert metric(url, "kvhandoff_bootstrap_registrations_refused_total") == 2
    # an engine whose ranks all leave is forgotten, and frees its place
    for tp in (0, 1):
        httpx.post(url + "/v1/ranks/deregister",
                   json={"engine_id": "e0", "tp_rank": tp}).raise_for_status()
    assert httpx.get(url + "/v1/engines/e0").status_code == 404
    httpx.post(url + "/v1/ranks", json=rank_body("e3")).raise_for_status()
    assert metric(url, "kvhandoff_bootstrap_engines_forgotten_total") == 1
    assert [e["engine_id"] for e in httpx.get(url + "/v1/engines").json()] == ["e1", "e2", "e3"]


def test_ready_and_metrics_size_do_not_grow_with_registrations(bootstrap_server: Server) -> None:
    url = bootstrap_server()
    sizes: dict[str, list[int]] = {"ready": [], "metrics": []}

    def measure() -> dict[str, Any]:
        r = httpx.get(url + "/ready")
        sizes["ready"].append(len(r.content))
        m = httpx.get(url + "/metrics")
        sizes["metrics"].append(len(m.content))
        body: dict[str, Any] = r.json()
        return body

    httpx.post(url + "/v1/ranks", json=rank_body("big", dp_size=8, tp_size=64)).raise_for_status()
    first = measure()
    assert first["missing_ranks"] == 511
    for tp in range(1, 64):  # a whole dp group: 64 more registrations
        httpx.post(url + "/v1/ranks",
                   json=rank_body("big", tp=tp, dp_size=8, tp_size=64)).raise_for_status()
    for i in range(40):  # and 40 more engines, one of them degraded
        httpx.post(url + "/v1/ranks", json=rank_body(
            f"small{i:02}", tp_size=1, transport="tcp" if i == 7 else "inproc"),
        ).raise_for_status()
    last = measure()
    assert last["engine_count"] == 41 and len(last["engines"]) == 16
    assert last["engines"][0]["engine_id"] == "big"  # incomplete engines come first
    assert last["engines"][0]["missing_ranks"] == 448
    assert last["live_ranks"] == 64 + 40 and last["expected_ranks"] == 512 + 40
    assert last["missing_ranks"] == 448 and len(last["missing"]) == 16
    assert last["degraded_ranks"] == 1 and last["degraded"] == ["small07/dp0/cp0/tp0/pp0 (tcp)"]
    assert max(sizes["ready"]) < READY_MAX_BYTES
    # /metrics: the same series whatever is registered (only the counts' digits and the
    # request counters move)
    assert sizes["metrics"][1] - sizes["metrics"][0] < 2048, sizes
    assert metric(url, "kvhandoff_bootstrap_engines_live") == 41


def test_listings_are_paged(bootstrap_server: Server) -> None:
    url = bootstrap_server()
    for tp in range(12):
        httpx.post(url + "/v1/ranks", json=rank_body("a", tp=tp, tp_size=12)).raise_for_status()
    for tp in range(3):
        httpx.post(url + "/v1/ranks", json=rank_body("b", tp=tp, tp_size=4)).raise_for_status()
    seen = []
    for offset in range(0, 20, 4):
        page = httpx.get(url + f"/v1/ranks?offset={offset}&limit=4").json()
        assert len(page) == (4 if offset < 12 else 3 if offset == 12 else 0)
        seen += [(p["engine_id"], p["tp_rank"]) for p in page]
    assert seen == [("a", t) for t in range(12)] + [("b", t) for t in range(3)]
    assert [e["engine_id"] for e in httpx.get(url + "/v1/engines?offset=1&limit=5").json()] \
        == ["b"]
    topo = httpx.get(url + "/v1/engines/b").json()
    assert [r["tp_rank"] for r in topo["ranks"]] == [0, 1, 2]
    assert [m["tp_rank"] for m in topo["missing"]] == [3]


def test_an_engine_expires_with_its_last_rank(bootstrap_server: Server) -> None:
    clock = FakeClock()
    url = bootstrap_server(rank_ttl_s=30, clock=clock)
    for e in ("alive", "crashed", "half"):
        for tp in (0, 1):
            httpx.post(url + "/v1/ranks", json=rank_body(e, tp=tp)).raise_for_status()
    assert httpx.get(url + "/ready").status_code == 200
    clock.advance(20)
    for e, tps in (("alive", (0, 1)), ("half", (0,))):
        for tp in tps:
            httpx.post(url + "/v1/ranks/heartbeat",
                       json={"engine_id": e, "tp_rank": tp, "generation": "g1"}
                       ).raise_for_status()
    clock.advance(20)  # 40 s since "crashed" and half/tp1 were last heard of
    assert httpx.get(url + "/v1/engines/crashed").status_code == 404
    ready = httpx.get(url + "/ready")
    body = ready.json()
    # "crashed" is gone with its last rank; "half" still has a live rank, so it is expected
    # whole and /ready says what it lacks
    assert ready.status_code == 503 and body["engine_count"] == 2
    assert body["missing"] == [{"engine_id": "half", "dp_rank": 0, "cp_rank": 0, "tp_rank": 1,
                                "pp_rank": 0}]
    assert metric(url, "kvhandoff_bootstrap_engines_forgotten_total") == 1
    # "half" crashes for good too: once its last rank expires, /ready is about "alive" only
    httpx.post(url + "/v1/ranks/heartbeat",
               json={"engine_id": "alive", "tp_rank": 0, "generation": "g1"}).raise_for_status()
    httpx.post(url + "/v1/ranks/heartbeat",
               json={"engine_id": "alive", "tp_rank": 1, "generation": "g1"}).raise_for_status()
    clock.advance(15)
    ready = httpx.get(url + "/ready")
    assert ready.status_code == 200, ready.text
    assert [e["engine_id"] for e in ready.json()["engines"]] == ["alive"]
    # everything crashes: not ready, and saying why; a redeploy with another topology is taken
    clock.advance(31)
    ready = httpx.get(url + "/ready")
    assert ready.status_code == 503 and ready.json()["engine_count"] == 0
    assert "missed rank_ttl_s" in ready.json()["reason"]
    httpx.post(url + "/v1/ranks", json=rank_body("crashed", tp_size=1)).raise_for_status()
    assert httpx.get(url + "/ready").status_code == 200


# -- SGLang's own DSpark layout is accepted as it sends it ---------------------------------------

@cache
def _sglang_dsv41_spec_layout() -> Callable[..., Any]:
    """``get_dsv41_spec_layout`` compiled from the installed sglang/srt/disaggregation/utils.py
    (the module itself needs torchvision to import), with ``get_spec`` answering DSpark."""
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.submodule_search_locations
    path = Path(next(iter(spec.submodule_search_locations))) / "srt/disaggregation/utils.py"
    tree = ast.parse(path.read_text(), filename=str(path))
    fn = next(n for n in tree.body
              if isinstance(n, ast.FunctionDef) and n.name == "get_dsv41_spec_layout")
    ns: dict[str, Any] = {
        "Optional": __import__("typing").Optional, "KVArgs": object,
        "get_spec": lambda: types.SimpleNamespace(speculative_algorithm="DSPARK",
                                                  speculative_num_draft_tokens=4),
    }
    module = ast.Module(body=[ast.ImportFrom("__future__", [ast.alias("annotations")], 0), fn],
                        type_ignores=[])
    exec(compile(ast.fix_missing_locations(module), str(path), "exec"), ns)  # noqa: S102
    return ns["get_dsv41_spec_layout"]  # type: ignore[no-any-return]


def test_sglangs_own_dsv41_layout_is_typed_and_echoed(bootstrap_server: Server) -> None:
    from sglang.srt.disaggregation.base.conn import StateType

    kv_args = types.SimpleNamespace(
        mla_compression_ratios=[1, 2, 4], kv_layer_ids=list(range(61)),
        kv_item_lens=[656] * 61, state_types=[StateType.SWA, StateType.SWA],
        state_item_lens=[[1024] * 61, [512] * 3])
    layout = _sglang_dsv41_spec_layout()(kv_args)
    assert layout is not None and layout["state_types"] == ["swa", "swa"]
    url = bootstrap_server()
    r = httpx.put(url + "/route", json=sglang_put(dsv41_spec_layout=layout))
    assert r.status_code == 200, r.text
    info = httpx.get(url + "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1"
                           "&target_pp_rank=-1").json()
    assert info["dsv41_spec_layout"] == layout
    # a kvhandoff LayoutSpec object is a kv_layout too
    r = httpx.put(url + "/route", json=sglang_put(kv_layout=GLM.to_dict(),
                                                  dsv41_spec_layout=layout))
    assert r.status_code == 200, r.text
