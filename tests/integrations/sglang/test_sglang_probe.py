"""The SGLang layout probe (issue 26): at manager start, known values written through SGLang's
own write ops into a scratch pool of the live pool's class are read back through the layout
the adapter built, slot by slot and plane by plane (latent/rope, indexer key/scale).

SGLang's write ops are Triton kernels: the verified cases run in a process of their own with
Triton's interpreter (``TRITON_INTERPRET=1``), which runs those kernels on CPU tensors. Without
it (this process) the kernels cannot run on a CPU: the manager starts with the in-page layout
not verified and says why; with ``layout_probe`` off it says so too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import sglang_env as E
import sglang_pools as P

HERE = Path(__file__).parent
pytestmark = pytest.mark.usefixtures("sglang_loaded")


def _child() -> dict[str, dict[str, Any]]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get(
        "PYTHONPATH", "")]), TRITON_INTERPRET="1", KVHANDOFF_TRANSPORT="ucx",
        SGLANG_HOST_IP="127.0.0.1", SGLANG_PLUGINS="kvhandoff")
    env.pop("KVHANDOFF_BOOTSTRAP_URL", None)
    p = subprocess.run([sys.executable, str(HERE / "sglang_probe_child.py")], env=env,
                       capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    out = {}
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            rec = json.loads(line[len("RESULT "):])
            out[rec["name"]] = rec
    return out


@pytest.mark.timeout(450)
def test_probe_verifies_sglangs_pools_and_refuses_wrong_layouts_naming_the_slot() -> None:
    r = _child()
    for config in ("glm-5.3", "glm-5.3-kpool2"):
        assert r[config]["report"] == (
            "layout verified against DSATokenToKVPool: kv (4 slots: latent, rope), indexer "
            "(4 row slots: key, scale)"), r[config]
    # the indexer's scale plane read before its key plane: refused, slot and plane named
    bad = r["indexer_scale_first"]
    assert bad["refused"] and bad["backend"] == "DSATokenToKVPool"
    assert bad["slot"] == 64 and bad["plane"] == "scale"
    assert "token slot 64 (page 1, row 0) plane 'scale'" in bad["message"]
    assert "the kernel's bytes were found at byte" in bad["message"]
    # the token row (latent, then rope) read as page-major planes: refused too
    bad = r["kv_page_major_planes"]
    assert bad["refused"] and bad["slot"] == 64 and bad["plane"] == "rope"
    assert "region 'kv'" in bad["message"]
    # a rank its bootstrap server refuses does not start
    bad = r["disagreeing_rank"]
    assert bad["refused"] and "PUT /route" in bad["message"], bad
    assert "disagrees with the first registrant" in bad["message"] and "page_size" in bad["message"]


def _manager(monkeypatch: pytest.MonkeyPatch, **env: str) -> Any:
    from sglang.srt.disaggregation.utils import DisaggregationMode

    from kvhandoff.integrations.sglang.bootstrap import KVHandoffKVBootstrapServer

    monkeypatch.delenv("KVHANDOFF_BOOTSTRAP_URL", raising=False)
    monkeypatch.setenv("KVHANDOFF_TRANSPORT", "ucx")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    srv = KVHandoffKVBootstrapServer("127.0.0.1", 0)
    sa = E.server_args("prefill", srv.port)
    mgr = E.kv_class("MANAGER")(
        P.kv_args(P.pools("glm-5.3")), DisaggregationMode.PREFILL, sa, True)
    mgr.close()
    srv.close()
    return mgr


def test_without_a_runnable_write_kernel_the_layout_is_reported_unverified(
        monkeypatch: pytest.MonkeyPatch) -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("Triton's interpreter is on in this process: the kernels run here")
    report = _manager(monkeypatch).probe_report
    assert report.startswith("layout NOT verified against DSATokenToKVPool: "
                             "DSATokenToKVPool's write kernel did not run on cpu")
    assert "whole pages" in report


def test_probe_off_is_said(monkeypatch: pytest.MonkeyPatch) -> None:
    report = _manager(monkeypatch, KVHANDOFF_LAYOUT_PROBE="false").probe_report
    assert report.startswith("layout probe off (layout_probe=false)")


def _cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="no CUDA device")
@pytest.mark.parametrize("config", ["glm-5.3", "glm-5.3-kpool2"])
def test_probe_on_cuda_runs_sglangs_triton_write_kernels(config: str) -> None:
    """The GPU path: the scratch pool on cuda:0, SGLang's Triton write kernels compiled for the
    device, the pages read back through device views of the pool (scripts/gpu_check.sh)."""
    from kvhandoff.integrations.sglang.layout import Parallel, build
    from kvhandoff.integrations.sglang.probe import verify

    E.server_args("prefill", 1)
    args = P.kv_args(P.pools(config))
    out = verify(args, build(args, is_mla=True, parallel=Parallel(), device="cpu"), "cuda:0")
    assert out.verified, out.report
    assert out.report.startswith("layout verified against DSATokenToKVPool")
