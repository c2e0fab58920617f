"""CUDA checks: the GPUs the driver and torch see, and whether CUDA IPC works between two
processes (what a same-host GPU handoff needs)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec

from .model import CheckResult, Status
from .system import nvidia_inventory

CUDA_TORCH_FIX = ("install a CUDA build of torch (e.g. from PyTorch's CUDA wheel index) "
                  "matching the driver")


def torch_cuda() -> dict[str, Any]:
    """What torch sees: version, CUDA build, device count and names (never raises)."""
    try:
        import torch
    except ImportError as e:
        return {"torch": None, "error": str(e), "available": False, "devices": []}
    out: dict[str, Any] = {"torch": torch.__version__, "cuda_build": torch.version.cuda,
                           "available": False, "devices": []}
    try:
        out["available"] = bool(torch.cuda.is_available())
        if out["available"]:
            out["devices"] = [torch.cuda.get_device_name(i)
                              for i in range(torch.cuda.device_count())]
    except Exception as e:  # a broken driver raises here: report it
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def check_cuda_devices(root: Path) -> CheckResult:
    inv = nvidia_inventory(root)
    tc = torch_cuda()
    details = {"driver": inv, "torch": tc}
    gpus: dict[str, str] = inv["gpus"]  # type: ignore[assignment]
    if tc["available"]:
        names = ", ".join(f"{i}: {n}" for i, n in enumerate(tc["devices"]))
        return CheckResult("cuda", Status.OK, f"torch {tc['torch']} (CUDA {tc['cuda_build']}) "
                           f"sees {len(tc['devices'])} GPU(s): {names}", details)
    if not gpus and not inv["dev_nodes"]:
        why = f"; torch {tc['torch']} built without CUDA" if tc.get("torch") and not \
            tc.get("cuda_build") else ""
        return CheckResult("cuda", Status.SKIP, f"no NVIDIA GPU on this node (no "
                           f"/proc/driver/nvidia/gpus, no /dev/nvidia*){why}", details)
    seen = ", ".join(gpus.values()) or ", ".join(inv["dev_nodes"])  # type: ignore[arg-type]
    if tc.get("torch") is None:
        return CheckResult("cuda", Status.FAIL, f"GPU(s) {seen} present but torch is not "
                           "installed", details, fix=CUDA_TORCH_FIX)
    if not tc.get("cuda_build"):
        return CheckResult("cuda", Status.FAIL, f"GPU(s) {seen} present but torch "
                           f"{tc['torch']} is a CPU-only build", details, fix=CUDA_TORCH_FIX)
    return CheckResult("cuda", Status.FAIL, f"GPU(s) {seen} present but torch (CUDA "
                       f"{tc['cuda_build']}) cannot use them: {tc.get('error', 'no device')}",
                       details, fix="check the driver (nvidia-smi), CUDA_VISIBLE_DEVICES and "
                       "that /dev/nvidia* are passed into the container")


def cuda_ipc_probe(device: int = 0, n: int = 1 << 20, timeout_s: float = 120.0
                   ) -> tuple[bool, str]:
    """Parent allocates a pattern on `device`, a child process opens it via CUDA IPC, checks it
    and writes the next pattern; the parent checks that. (ok, what happened)."""
    import torch

    seed = 11
    t = ((torch.arange(n, dtype=torch.int64, device=f"cuda:{device}") + seed) % 256).to(
        torch.uint8)
    torch.cuda.synchronize(device)
    fields = t.untyped_storage()._share_cuda_()  # type: ignore[no-untyped-call]
    keys = ("device", "handle", "size_bytes", "offset_bytes", "ref_counter_handle",
            "ref_counter_offset", "event_handle", "event_sync_required")
    req = dict(zip(keys, fields, strict=True))
    req.update(n=n, seed=seed)
    try:
        out = subprocess.run([sys.executable, "-m", "kvhandoff.doctor._cuda_ipc"],
                             input=msgspec.msgpack.encode(req), capture_output=True,
                             timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return False, f"the child process did not answer within {timeout_s:g} s"
    try:
        ans = msgspec.msgpack.decode(out.stdout)
    except msgspec.DecodeError:
        tail = out.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        return False, f"child exited {out.returncode}: {tail[0]}"
    if not ans.get("ok"):
        return False, f"child: {ans.get('error')}"
    torch.cuda.synchronize(device)
    want = ((torch.arange(n, dtype=torch.int64, device=t.device) + seed + 1) % 256).to(
        torch.uint8)
    if not torch.equal(t, want):
        return False, "the child's write through CUDA IPC did not reach the parent's buffer"
    return True, f"a second process read and wrote {n} bytes of cuda:{device} through CUDA IPC"


def check_cuda_ipc(*, probe: bool = True) -> CheckResult:
    tc = torch_cuda()
    if not tc["available"]:
        why = ("torch is not installed" if tc.get("torch") is None else
               f"torch {tc['torch']} is built without CUDA" if not tc.get("cuda_build") else
               "torch sees no CUDA device")
        return CheckResult("cuda_ipc", Status.SKIP, f"not checked: {why}", {"torch": tc})
    if not probe:
        return CheckResult("cuda_ipc", Status.SKIP, "not checked (--no-probes)", {"torch": tc})
    ok, how = cuda_ipc_probe()
    if ok:
        return CheckResult("cuda_ipc", Status.OK, how, {"torch": tc})
    return CheckResult("cuda_ipc", Status.FAIL, f"CUDA IPC between two processes fails: {how}",
                       {"torch": tc}, fix="run both engines in one IPC namespace (docker "
                       "--ipc=host, k8s hostIPC) with the same GPUs visible")
