"""What a test process needs to build SGLang's real disaggregation classes on a CPU machine:
SGLang importable (`sglang_cpu_import`), the kvhandoff plugin loaded through SGLang's own plugin
loader (the installed entry point), SGLang's process-wide runtime context set from a real
``ServerArgs`` (ranks stated as a launcher would publish them), and ``KVArgs`` over CPU tensors
from SGLang's own pool objects (`sglang_pools`: ``DSATokenToKVPool`` with its ``IndexKeyCache``,
the MTP draft pool, ``MetadataBuffers``, constructed on CPU) and filled by SGLang's own functions.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import sglang_pools

FULL_SIZE = os.environ.get("KVH_SGLANG_SHAPE") == "glm-5.3"  # bench_sglang_pair.py
# the SGLang pool configuration of this process (sglang_pools.CONFIGS); the pair test runs
# its workers with each of the GLM-5.3 ones
CONFIG = os.environ.get("KVH_SGLANG_CONFIG") or ("glm-5.3" if FULL_SIZE else "small")
# tokens per page (SGLang's DSA pool: 64-token physical indexer pages, x index_kpool)
PAGE = sglang_pools.CONFIGS[CONFIG].page
MAIN_BPT = 656  # fp8_ds_mla bytes per token per layer (GLM-5.3)
INDEXER_BPT = 128 + 4  # fp8 key + fp32 scale per token (GLM-5.3)
DTYPE = "fp8_e4m3"


def import_sglang(*, scheduler_modules: bool = True) -> None:
    """Imports SGLang's disaggregation modules (CPU stand-in for torchvision, see there);
    `scheduler_modules`: also ``prefill.py`` and ``decode.py`` (slow to import; the pair's
    workers make their calls themselves and skip them)."""
    os.environ.setdefault("SGLANG_HOST_IP", "127.0.0.1")
    os.environ.setdefault("SGLANG_PLUGINS", "kvhandoff")
    import sglang_cpu_import

    sglang_cpu_import.install()
    import sglang.srt.disaggregation.common.conn  # noqa: F401
    import sglang.srt.disaggregation.utils  # noqa: F401

    if scheduler_modules:
        import sglang.srt.disaggregation.decode  # noqa: F401
        import sglang.srt.disaggregation.prefill  # noqa: F401


def load_plugins() -> None:
    """SGLang's own plugin loader: finds our entry point (group ``sglang.srt.plugins``)."""
    from sglang.srt.plugins import load_plugins as sglang_load_plugins

    sglang_load_plugins()


def kv_class(kind: str) -> Any:
    """SGLang's ``get_kv_class`` for the kvhandoff backend (`kind`: MANAGER, SENDER, ...)."""
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    return get_kv_class(TransferBackend("kvhandoff"), getattr(KVClassType, kind))


def server_args(mode: str, bootstrap_port: int) -> Any:
    """A real ``ServerArgs`` published as this process's runtime context (rank 0 of TP1)."""
    from sglang.srt import runtime_context as rc
    from sglang.srt.server_args import ServerArgs

    sa = ServerArgs(model_path="dummy", host="127.0.0.1", device="cpu",
                    disaggregation_mode=mode, disaggregation_transfer_backend="kvhandoff",
                    disaggregation_bootstrap_port=bootstrap_port)
    rc.get_context().set_server_args(sa)
    rc.get_parallel().override_permanently(attn_tp_rank=0, attn_cp_rank=0, attn_dp_rank=0,
                                           attn_dcp_rank=0, pp_group=None)
    return sa


@dataclass
class Pools:
    """SGLang's pools (`sglang_pools`) and byte views of them the workers fill and check."""

    sglang: Any  # sglang_pools.Pools
    main: list[Any]  # per main-KV buffer (target, then draft): uint8 [pages, PAGE * 656]
    indexer: list[Any]  # per live indexer buffer (target, then draft): uint8 [pages, item]
    tail: list[Any]  # per live kpool tail buffer (keys then scores): uint8 [rows, slots * 256]
    aux: list[Any]  # per metadata buffer: uint8 [slots, item]


def _bytes(t: Any, rows: int) -> Any:
    """A uint8 [rows, -1] view of `t` (SGLang's memory, no copy)."""
    import torch

    return t.view(torch.uint8).reshape(rows, -1) if t.numel() else t.view(torch.uint8)


def pools(config: str | None = None, *, pages: int | None = None) -> Pools:
    """SGLang's pools of `config` (default `CONFIG`) on CPU and byte views of them."""
    import sglang_pools as P

    sp = P.pools(config or CONFIG, pages=pages)
    targets = [sp.target] + ([sp.draft] if sp.draft is not None else [])
    ps = sp.target.page_size
    main = [_bytes(b, b.shape[0] // ps) for pool in targets for b in pool.kv_buffer]
    indexer = [b for pool in targets for b in pool.index_key_cache.buffer if b.shape[0]]
    tail: list[Any] = []
    for part in ("_compress_tail_k", "_compress_tail_score"):
        for pool in targets:
            tail += [_bytes(b, b.shape[0]) for b in (getattr(pool, part, None) or [])
                     if b.shape[0]]
    aux = [_bytes(t, t.shape[0]) for t in _aux_tensors(sp.metadata)]
    return Pools(sglang=sp, main=main, indexer=indexer, tail=tail, aux=aux)


def _aux_tensors(meta: Any) -> list[Any]:
    """The tensors of SGLang's ``MetadataBuffers`` in ``get_buf_infos`` order (matched by data
    pointer)."""
    by_ptr = {v.data_ptr(): v for v in vars(meta).values()
              if hasattr(v, "data_ptr") and hasattr(v, "numel")}
    return [by_ptr[x] for x in meta.get_buf_infos()[0]]


def kv_args(p: Pools) -> Any:
    """SGLang's ``KVArgs`` as its scheduler fills them, from SGLang's own pools."""
    import sglang_pools as P

    return P.kv_args(p.sglang)


MAIN_LAYERS = {"small": 6}.get(CONFIG, 78)
INDEXER_LAYERS = {"small": 3}.get(CONFIG, 21)  # GLM-5.3 has an indexer on some layers only


def page_bytes(kind: str, layer: int, page: int, room: int, nbytes: int) -> np.ndarray:
    """The deterministic content prefill writes in (kind, layer, page) for `room`."""
    rng = np.random.default_rng([room, layer, page,
                                 {"main": 1, "indexer": 2, "aux": 3, "tail": 4}[kind]])
    return rng.integers(0, 256, nbytes, dtype=np.uint8)


def run_pair(port: int, **env: str) -> tuple[dict[str, dict[str, Any]], dict[str, str],
                                            dict[str, int]]:
    """Runs ``sglang_worker.py`` prefill and decode against the bootstrap server on `port` (UCX,
    extra environment `env`); per role: its RESULT records by name, its output, its exit
    code."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).parent
    full = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here), os.environ.get(
        "PYTHONPATH", "")]), KVHANDOFF_TRANSPORT="ucx", SGLANG_HOST_IP="127.0.0.1",
        SGLANG_PLUGINS="kvhandoff", **env)
    full.pop("KVHANDOFF_BOOTSTRAP_URL", None)
    procs = {role: subprocess.Popen([sys.executable, str(here / "sglang_worker.py"), role,
                                     str(port)], env=full, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)
             for role in ("prefill", "decode")}
    out: dict[str, dict[str, Any]] = {"prefill": {}, "decode": {}}
    logs = {}
    try:
        for role, p in procs.items():
            logs[role], _ = p.communicate(timeout=240)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    for role, text in logs.items():
        for line in text.splitlines():
            if line.startswith("RESULT "):
                rec = json.loads(line[len("RESULT "):])
                out[role][rec.get("name", "ready")] = rec
    return out, logs, {role: int(p.returncode) for role, p in procs.items()}
