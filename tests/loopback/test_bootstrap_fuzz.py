"""Property fuzz of the OpenAPI schema against the real server: no input gives a 5xx.

Positive (schema-valid) and negative (schema-violating) cases, on a server that already holds
a complete native engine and a complete SGLang engine, so lookups reach the deep paths too.

The fuzz runs in a Python process of its own (this module run as a script): schemathesis
imports most of its modules lazily, inside the fuzz, and inside pytest those imports go through
assertion rewriting (schemathesis is a pytest plugin), whose `ast.parse` raised CPython 3.11.7's
"AST constructor recursion depth mismatch" SystemError once late in a full `make test` (not
alone, not in other full runs). Outside pytest the modules import as they do for a user.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from collections.abc import Callable

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from kvhandoff.bootstrap_server import BootstrapClient
from kvhandoff.kv_layout import preset

Server = Callable[..., str]


def seed(url: str) -> None:
    c = BootstrapClient(url, total_wait_s=0)
    for tp in range(2):
        c.register_rank(engine_id="p", role="prefill", agent_address=f"127.0.0.1:{7100 + tp}",
                        generation="g", layout=preset("glm-5.3"), tp_rank=tp, tp_size=2)
    (room,) = c.allocate_rooms(1)
    c.bind_room(room, "p", 0)
    httpx.put(url + "/route", json={
        "attn_tp_size": 1, "attn_tp_rank": 0, "attn_dp_size": 1, "attn_dp_rank": 0,
        "pp_size": 1, "pp_rank": 0, "rank_ip": "127.0.0.1", "rank_port": 7200,
        "page_size": 64, "kv_cache_dtype": "auto"}).raise_for_status()


def fuzz(url: str, examples: int) -> Counter[int]:
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    cases = st.one_of(schema.as_strategy(),
                      schema.as_strategy(generation_mode=schemathesis.GenerationMode.NEGATIVE))
    seen: Counter[int] = Counter()

    @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(cases)
    def run(case: schemathesis.Case) -> None:
        r = case.call(base_url=url, timeout=10)
        seen[r.status_code] += 1
        assert r.status_code < 500, (case.method, case.formatted_path, case.query, case.body,
                                     r.status_code, r.text[:500])

    run()
    return seen


def fuzz_in_child(url: str, examples: int) -> Counter[int]:
    """`fuzz` in a fresh Python process (see the module docstring): the status codes seen."""
    proc = subprocess.run([sys.executable, __file__, url, str(examples)], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, f"fuzz process exited {proc.returncode}:\n{proc.stderr[-6000:]}"
    return Counter({int(k): v for k, v in json.loads(proc.stdout.splitlines()[-1]).items()})


def test_openapi_fuzz_no_5xx(bootstrap_server: Server) -> None:
    url = bootstrap_server()
    seed(url)
    seen = fuzz_in_child(url, 150)
    assert sum(seen.values()) >= 100
    assert any(s < 300 for s in seen) and any(400 <= s < 500 for s in seen)


@pytest.mark.long
def test_openapi_fuzz_no_5xx_long(bootstrap_server: Server) -> None:
    url = bootstrap_server()
    seed(url)
    seen = fuzz_in_child(url, 1500)
    assert sum(seen.values()) >= 1000


if __name__ == "__main__":  # the fuzz process: url, examples; prints the status codes seen
    print(json.dumps(fuzz(sys.argv[1], int(sys.argv[2]))))
