"""The layouts of issue 17 handed off between two real processes (`layouts_child.py`), each
with its own `TransferAgent` over the real `tcp` transport on 127.0.0.1: packed vLLM blocks,
index_kpool = 2, 0-row (placeholder) layers, MTP draft layers, and packed <-> per-layer both
ways. The decode process checks every row it should hold against the pattern at its own
addresses, that its cached-prefix indexer pages kept their mark, and that exactly the expected
number of bytes was written anywhere in its memory."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from kvhandoff.kv_layout import LayoutSpec, Plane, RegionSpec, SendFrom, preset

CHILD = Path(__file__).with_name("layouts_child.py")
WAIT_S = 90.0  # process start + one small room on a loaded 2-core machine


class Child:
    def __init__(self, role: str, cfg: dict[str, Any]) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, str(CHILD), role, json.dumps(cfg)],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=env)
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.err: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=lambda: self.err.extend(self.proc.stderr or []),
                         daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout or []:
            if line.startswith("{"):
                self.events.put(json.loads(line))
        self.events.put({"event": "exit"})

    def expect(self, kind: str) -> dict[str, Any]:
        while True:
            try:
                ev = self.events.get(timeout=WAIT_S)
            except queue.Empty:
                raise AssertionError(f"no {kind!r} within {WAIT_S} s; stderr: "
                                     f"{''.join(self.err)[-2000:]}") from None
            if ev["event"] == "exit":
                raise AssertionError(f"exited before {kind!r}: {''.join(self.err)[-2000:]}")
            if ev["event"] == kind:
                return ev

    def close(self) -> None:
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def handoff(prefill: LayoutSpec, decode: LayoutSpec, *, seq_len: int, prefix: int
            ) -> tuple[dict[str, Any], dict[str, Any]]:
    p = Child("prefill", {"layout": prefill.to_dict(), "seq_len": seq_len, "seed": 1})
    d = None
    try:
        addr = p.expect("ready")["address"]
        d = Child("decode", {"layout": decode.to_dict(), "seq_len": seq_len, "prefix": prefix,
                             "peer": addr, "seed": 1})
        return p.expect("done"), d.expect("done")
    finally:
        p.close()
        if d is not None:
            d.close()


def moved_bytes(spec: LayoutSpec, seq_len: int, prefix: int) -> int:
    ps = spec.page_size_tokens
    held = (prefix // ps) * ps
    return sum(r.nbytes_for(seq_len - (held if r.send_from is SendFrom.DECODE_PREFIX else 0))
               * r.num_live_layers for r in spec.regions)


def assert_exact(pre: dict[str, Any], dec: dict[str, Any], spec: LayoutSpec, seq_len: int,
                 prefix: int) -> None:
    assert dec["state"] == "Success", dec["failure"]
    assert pre["state"] == "Success", pre["failure"]
    want = moved_bytes(spec, seq_len, prefix)
    assert dec["expected"] == want
    assert dec["bad"] == 0
    assert dec["written"] == want  # nothing strayed anywhere else in the decode's memory
    assert dec["marks_left"] == dec["marks"]
    assert dec["stats"]["bytes"] == want


def small_glm(name: str, **kw: Any) -> LayoutSpec:
    """A GLM-5.3 preset with 3 indexer layers (fewer bytes, the same structure)."""
    return preset(name, indexer_layers=3, **kw)


def test_vllm_packed_block_with_mtp_draft_layers_to_the_same() -> None:
    spec = preset("glm-5.3", indexer_layers=3, mtp_layers=1, packing="block")
    assert spec.rows and spec.draft_layer_ids == (78,)
    pre, dec = handoff(spec, spec, seq_len=200, prefix=70)
    assert_exact(pre, dec, spec, 200, 70)


def test_kpool2_with_zero_row_placeholder_layers() -> None:
    """SGLang's indexer pool: a buffer slot for every layer, 0 rows on the shared layers;
    index_kpool = 2 (main page 128 tokens, indexer page 64 rows)."""
    full = (0, 4, 9)
    idx = RegionSpec("indexer_k", tuple(range(10)), (Plane("key", 128), Plane("scale", 4)),
                     send_from=SendFrom.DECODE_PREFIX, tokens_per_row=2,
                     empty_layers=tuple(i for i in range(10) if i not in full))
    spec = LayoutSpec(128, "fp8_ds_mla",
                      (RegionSpec("main_kv", tuple(range(10)), (Plane("latent", 656),)), idx),
                      model="glm-like")
    pre, dec = handoff(spec, spec, seq_len=301, prefix=200)
    assert_exact(pre, dec, spec, 301, 200)


@pytest.mark.parametrize(("src", "dst"), [("glm-5.3-vllm", "glm-5.3"),
                                          ("glm-5.3", "glm-5.3-vllm-mla")])
def test_packed_and_per_layer_both_ways(src: str, dst: str) -> None:
    p_spec, d_spec = small_glm(src), small_glm(dst)
    pre, dec = handoff(p_spec, d_spec, seq_len=150, prefix=70)
    assert_exact(pre, dec, d_spec, 150, 70)
