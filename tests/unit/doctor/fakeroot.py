"""Builds fake system roots (a tmp directory laid out like /) for the doctor's checks."""

from __future__ import annotations

import os
from pathlib import Path


def put(root: Path, path: str, text: str = "") -> Path:
    p = root / path.lstrip("/")
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    return p


def limits(memlock_soft: str, memlock_hard: str | None = None) -> str:
    hard = memlock_hard or memlock_soft
    return ("Limit                     Soft Limit           Hard Limit           Units     \n"
            "Max cpu time              unlimited            unlimited            seconds   \n"
            f"Max locked memory         {memlock_soft:<21}{hard:<21}bytes     \n"
            "Max open files            1048576              1048576              files     \n")


def rdma_node(root: Path, *, state: str = "4: ACTIVE", uverbs: bool = True,
              rdma_cm: bool = True) -> None:
    put(root, "/sys/class/infiniband/mlx5_0/ports/1/state", state + "\n")
    put(root, "/sys/class/infiniband/mlx5_0/ports/1/link_layer", "InfiniBand\n")
    (root / "dev/infiniband").mkdir(parents=True, exist_ok=True)
    if uverbs:
        put(root, "/dev/infiniband/uverbs0")
    if rdma_cm:
        put(root, "/dev/infiniband/rdma_cm")


def fake_ucx(root: Path, *, modules: tuple[str, ...], flags: str, version: str = "1.18.0",
             have_cuda: bool = True) -> str:
    """A UCX install under <root>/opt/ucx (empty .so files, a ucx_info script) and a
    /proc/self/maps that maps its libucp and libucs. Returns the libucp path as mapped."""
    lib = "/opt/ucx/lib"
    for so in ("libucp.so.0", "libucs.so.0"):
        put(root, f"{lib}/{so}")
    for m in modules:
        put(root, f"{lib}/ucx/libuct_{m}.so")
    uct = "".join(f":{m}" for m in modules)
    script = put(root, "/opt/ucx/bin/ucx_info", f"""#!/bin/sh
case "$1" in
  -v) echo "# Library version: {version}"; echo "# Configured with: {flags}";;
  -b) echo "#define HAVE_CUDA                 {1 if have_cuda else 0}"
      echo '#define UCX_CONFIGURE_FLAGS       "{flags}"'
      echo '#define uct_MODULES               "{uct}"';;
esac
""")
    os.chmod(script, 0o755)
    put(root, "/proc/self/maps",
        f"7f0000000000-7f0000001000 r-xp 00000000 08:01 123 {lib}/libucs.so.0\n"
        "7f0000002000-7f0000003000 r--p 00000000 08:01 124 /usr/lib/libc.so.6\n"
        f"7f0000004000-7f0000005000 r-xp 00000000 08:01 125 {lib}/libucp.so.0\n")
    return f"{lib}/libucp.so.0"
