"""`python -m kvhandoff.bench.devsum`: the cost of the device checksum (`buffers.devsum`)
against a contiguous copy and a page-gather copy of the same bytes on the same device."""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from kvhandoff.buffers.devsum import devsum


def _bench(device: str, mib: int, page_tokens: int, token_bytes: int, repeat: int) -> None:
    import torch

    dev = torch.device(device)
    pages = max(1, (mib << 20) // (page_tokens * token_bytes))
    pool_pages = pages * 2
    page_nb = page_tokens * token_bytes
    buf = torch.randint(0, 256, (pool_pages * page_nb,), dtype=torch.uint8, device=dev)
    table = torch.randperm(pool_pages)[:pages].numpy()
    off = table.astype(np.int64) * page_nb
    nb = np.full(pages, page_nb, dtype=np.int64)
    total = int(nb.sum())
    idx = (torch.as_tensor(off, device=dev)[:, None]
           + torch.arange(page_nb, device=dev)[None, :]).reshape(-1)
    out = torch.empty(total, dtype=torch.uint8, device=dev)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def timed(fn: Any) -> float:
        fn()
        sync()
        best = float("inf")
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            sync()
            best = min(best, time.perf_counter() - t0)
        return best

    contiguous = buf[:total]
    t_copy = timed(lambda: out.copy_(contiguous))
    t_gather = timed(lambda: torch.index_select(buf, 0, idx, out=out))
    t_sum = timed(lambda: devsum(buf, off, nb))
    gbs = total / 1e9
    print(f"devsum bench on {device}: {pages} pages of {page_tokens} tokens x {token_bytes} B "
          f"= {total / 2**20:.0f} MiB scattered in a {pool_pages}-page pool, best of {repeat}")
    print(f"  contiguous copy      {t_copy * 1e3:9.3f} ms  {gbs / t_copy:8.2f} GB/s  (baseline)")
    print(f"  page gather copy     {t_gather * 1e3:9.3f} ms  {gbs / t_gather:8.2f} GB/s  "
          f"{t_gather / t_copy:6.2f}x copy")
    print(f"  devsum (torch ops)   {t_sum * 1e3:9.3f} ms  {gbs / t_sum:8.2f} GB/s  "
          f"{t_sum / t_copy:6.2f}x copy, {t_sum / t_gather:6.2f}x gather copy")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m kvhandoff.bench.devsum",
                                description="Cost of the device checksum against a copy of "
                                "the same bytes on the same device.")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--mib", type=int, default=64, help="bytes of the page set, in MiB")
    p.add_argument("--page-tokens", type=int, default=16)
    p.add_argument("--token-bytes", type=int, default=656, help="bytes per token (656: GLM "
                   "MLA fp8)")
    p.add_argument("--repeat", type=int, default=5)
    a = p.parse_args(argv)
    _bench(a.device, a.mib, a.page_tokens, a.token_bytes, a.repeat)


if __name__ == "__main__":
    main()
