"""The SGLang layout probe in a process of its own (run by test_sglang_probe.py):

    TRITON_INTERPRET=1 python sglang_probe_child.py

SGLang's cache-write kernels are Triton kernels; Triton's interpreter (``TRITON_INTERPRET=1``,
read when triton is imported, hence a fresh process) runs them on CPU tensors. Prints one JSON
line per case: the manager's probe report for each GLM-5.3 configuration built from SGLang's own
pools, and the refusals of deliberately wrong layouts (slot, plane, message).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import sglang_env as E
import sglang_pools as P


def emit(**kw: Any) -> None:
    print("RESULT " + json.dumps(kw), flush=True)


def main() -> None:
    E.import_sglang(scheduler_modules=False)
    E.load_plugins()
    from sglang.srt.disaggregation.utils import (
        DisaggregationMode,
        KVClassType,
        TransferBackend,
        get_kv_class,
    )

    from kvhandoff.integrations.layout_probe import LayoutProbeError
    from kvhandoff.integrations.sglang.bootstrap import KVHandoffKVBootstrapServer
    from kvhandoff.integrations.sglang.probe import (
        check_pool,
        scratch_built,
        scratch_pool,
        wrong_planes,
    )
    from kvhandoff.kv_layout import Plane

    manager = get_kv_class(TransferBackend("kvhandoff"), KVClassType.MANAGER)
    for config in ("glm-5.3", "glm-5.3-kpool2"):
        # a bootstrap server each: the two configs' page sizes differ, and the server refuses
        # a rank of engine 'sglang' that disagrees with its first registrant (a ConfigError at
        # the manager's start)
        srv = KVHandoffKVBootstrapServer("127.0.0.1", 0)
        sa = E.server_args("prefill", srv.port)
        args = P.kv_args(P.pools(config))
        mgr = manager(args, DisaggregationMode.PREFILL, sa, True)
        emit(name=config, report=mgr.probe_report)
        mgr.close()
        srv.close()
    # a prefill rank whose registration its bootstrap server refuses (another page size than
    # the engine's first registrant) stops at start, the server's reason named (SGLang's own
    # registration logs it and serves a prefill no decode finds)
    from kvhandoff.errors import ConfigError

    srv = KVHandoffKVBootstrapServer("127.0.0.1", 0)
    sa = E.server_args("prefill", srv.port)
    manager(P.kv_args(P.pools("glm-5.3")), DisaggregationMode.PREFILL, sa, True).close()
    try:
        manager(P.kv_args(P.pools("glm-5.3-kpool2")), DisaggregationMode.PREFILL, sa,
                True).close()
        emit(name="disagreeing_rank", refused=False)
    except ConfigError as e:
        emit(name="disagreeing_rank", refused=True, message=str(e))
    srv.close()
    # deliberately wrong layouts over the same scratch pool: refused, the slot named
    args = P.kv_args(P.pools("glm-5.3"))
    from kvhandoff.integrations.sglang.layout import Parallel, build

    built = build(args, is_mla=True, parallel=Parallel(), device="cpu")
    pool = scratch_pool(args, built, "cpu")
    sb = scratch_built(pool, args, "cpu")
    kv = sb.kv_layout.region("kv")
    # the token row read as two page-major planes (all latents, then all ropes)
    split = dataclasses.replace(kv, planes=(Plane("latent", 528), Plane("rope", 128)),
                                placement=None)
    cases = {
        "indexer_scale_first": wrong_planes(sb.kv_layout, "indexer"),
        "kv_page_major_planes": dataclasses.replace(
            sb.kv_layout, regions=tuple(split if r.name == "kv" else
                                        dataclasses.replace(r, placement=None)
                                        for r in sb.kv_layout.regions)),
    }
    for name, wrong in cases.items():
        try:
            check_pool(pool, wrong, sb.kv_buffers)
            emit(name=name, refused=False)
        except LayoutProbeError as e:
            emit(name=name, refused=True, backend=e.backend, slot=e.slot, plane=e.plane,
                 message=str(e))


if __name__ == "__main__":
    main()
