"""The bootstrap server over IPv6 loopback (``[::1]``): `kvhandoff serve --host ::1`, SGLang's
own prefill registration and decode lookups, the native API through `BootstrapClient`, and the
vLLM connector's ``[::1]:port`` forms. Skipped, saying why, where the machine has no ``::1``."""

from __future__ import annotations

import http.client
import json

import pytest
from ipv6_loopback import needs_ipv6_loopback
from test_bootstrap_defaults import (
    DP_SIZE,
    ROUTE_PATH,
    TP_SIZE,
    lookups,
    needs_sglang,
    not_lifecycle,
    rank_port,
    register_sglang_prefill,
    serve,
)

from kvhandoff.bootstrap_server.client import BootstrapClient
from kvhandoff.kv_layout import preset

pytestmark = needs_ipv6_loopback


@needs_sglang
def test_serve_on_ipv6_loopback_with_sglang_prefill_and_lookups() -> None:
    with serve(host="::1") as s:
        assert s.url == f"http://[::1]:{s.port}"
        # SGLang's own register_to_bootstrap: NetworkAddress("::1", port).to_url() and
        # rank_ip "::1", as a prefill on an IPv6-only host sends it
        payloads = register_sglang_prefill("::1", s.port, rank_ip="::1")
        assert {p["rank_ip"] for p in payloads} == {"::1"}
        lookups(s, 200, rank_ip="::1")
        conn = http.client.HTTPConnection("::1", s.port, timeout=30)
        conn.request("GET", ROUTE_PATH.format(dp=-1, tp=-1).replace("cp_rank=0", "cp_rank=-1")
                     .replace("pp_rank=0", "pp_rank=-1"))
        r = conn.getresponse()
        info = json.loads(r.read())
        conn.close()
        assert r.status == 200, info
        assert (info["dp_size"], info["attn_tp_size"]) == (DP_SIZE, TP_SIZE)
    # ::1 is loopback: no warning about serving without a token, and nothing else either
    assert not not_lifecycle(s.stderr), s.stderr[:40]
    puts = [line for line in s.stdout if '"PUT /route HTTP/1.1" 200' in line]
    assert len(puts) == DP_SIZE * TP_SIZE and all("::1:" in line for line in puts), puts


@pytest.mark.parametrize("host", ["::1", "[::1]"])
def test_native_api_and_client_over_ipv6(host: str) -> None:
    with serve(host=host) as s, BootstrapClient(s.url) as c:
        assert s.url == f"http://[::1]:{s.port}"
        for tp in range(2):
            c.register_rank(engine_id="p", role="prefill", agent_address=f"[::1]:{9000 + tp}",
                            generation="g", layout=preset("glm-5.3"), tp_rank=tp, tp_size=2)
        ranks = c.lookup_route(engine_id="p", dp_rank=0, tp_rank=1, tp_size=2)
        assert [r.agent_address for r in ranks] == ["[::1]:9001"]
        assert c.ready().ready
    assert not not_lifecycle(s.stderr), s.stderr[:40]


def test_vllm_params_ipv6_forms_reach_the_server() -> None:
    """The vLLM connector's ``remote_host``/``remote_port`` and ``[::1]:port`` forms give an
    address `BootstrapClient` reaches over IPv6."""
    from kvhandoff.integrations.vllm.params import RemotePrefill, split_addr

    with serve(host="::1") as s:
        assert split_addr(s.url) == ("::1", s.port)
        assert split_addr(f"[::1]:{s.port}") == ("::1", s.port)
        for params in ({"remote_host": "::1", "remote_port": s.port},
                       {"remote_bootstrap_addr": f"[::1]:{s.port}"}):
            rp = RemotePrefill.parse({"remote_room": 7, "remote_num_tokens": 16, **params})
            assert rp.bootstrap_addr == f"[::1]:{s.port}", params
            with BootstrapClient(f"http://{rp.bootstrap_addr}") as c:
                c.register_rank(engine_id="p", role="prefill", agent_address="[::1]:9000",
                                generation="g", layout=preset("glm-5.3"))
                ranks = c.lookup_route(engine_id="p", dp_rank=0)
                assert [r.agent_address for r in ranks] == ["[::1]:9000"]
    assert not not_lifecycle(s.stderr), s.stderr[:40]


def test_sglang_decode_routes_ipv6_rank_through_the_fast_path() -> None:
    """Also without SGLang installed: a rank PUT with ``rank_ip`` "::1" over one keep-alive
    IPv6 connection is answered as "::1" (brackets are for URLs, not for the answer)."""
    with serve(host="::1") as s:
        conn = http.client.HTTPConnection("::1", s.port, timeout=30)
        try:
            body = {"attn_tp_size": 1, "attn_tp_rank": 0, "attn_cp_size": 1, "attn_cp_rank": 0,
                    "attn_dp_size": 1, "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0,
                    "system_dp_size": 1, "system_dp_rank": 0, "rank_ip": "::1",
                    "rank_port": rank_port(0, 0), "page_size": 64, "kv_cache_dtype": "auto"}
            conn.request("PUT", "/route", body=json.dumps(body),
                         headers={"content-type": "application/json"})
            r = conn.getresponse()
            assert (r.status, r.read()) == (200, b"OK")
            conn.request("GET", ROUTE_PATH.format(dp=0, tp=0))
            r = conn.getresponse()
            assert r.status == 200
            assert json.loads(r.read()) == {"rank_ip": "::1", "rank_port": rank_port(0, 0)}
        finally:
            conn.close()
