"""The doctor's CUDA checks: what the driver files and torch show, CUDA IPC when torch sees a
GPU (tests/unit/gpu runs the IPC probe itself on a GPU machine)."""

from __future__ import annotations

from pathlib import Path

import torch

from kvhandoff.doctor import Status, check_cuda_devices, check_cuda_ipc
from kvhandoff.doctor.system import nvidia_inventory

from .fakeroot import put

REAL = Path("/")


def _driver_gpus(root: Path) -> bool:
    return any((root / "proc/driver/nvidia/gpus").glob("*")) or any(
        (root / "dev").glob("nvidia[0-9]*"))


def test_cuda_devices_real_system() -> None:
    r = check_cuda_devices(REAL)
    if torch.cuda.is_available():
        assert r.status is Status.OK
        assert len(r.details["torch"]["devices"]) == torch.cuda.device_count()
    elif not _driver_gpus(REAL):  # this machine: no GPU, CPU torch
        assert r.status is Status.SKIP and "no NVIDIA GPU on this node" in r.summary
        if torch.version.cuda is None:
            assert "built without CUDA" in r.summary
    else:
        assert r.status is Status.FAIL and r.fix


def test_cuda_devices_fake_root_gpu_present(tmp_path: Path) -> None:
    put(tmp_path, "/proc/driver/nvidia/gpus/0000:19:00.0/information",
        "Model: \t\t NVIDIA H200\nIRQ:   \t\t 17\n")
    put(tmp_path, "/proc/driver/nvidia/version", "NVRM version: NVIDIA UNIX x86_64 Kernel "
        "Module  570.86.15\nGCC version: gcc 12\n")
    put(tmp_path, "/dev/nvidia0")
    put(tmp_path, "/dev/nvidiactl")
    inv = nvidia_inventory(tmp_path)
    assert inv == {"gpus": {"0000:19:00.0": "NVIDIA H200"}, "dev_nodes": ["nvidia0"],
                   "driver": "NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.86.15"}
    r = check_cuda_devices(tmp_path)
    if torch.cuda.is_available():
        assert r.status is Status.OK
    elif torch.version.cuda is None:  # this machine: the node has a GPU, torch cannot use it
        assert r.status is Status.FAIL and "CPU-only build" in r.summary
        assert "NVIDIA H200" in r.summary and "CUDA build of torch" in (r.fix or "")


def test_cuda_devices_fake_root_none(tmp_path: Path) -> None:
    r = check_cuda_devices(tmp_path)
    if not torch.cuda.is_available():
        assert r.status is Status.SKIP and r.details["driver"]["gpus"] == {}


def test_cuda_ipc_skips_with_the_reason_without_a_gpu() -> None:
    r = check_cuda_ipc(probe=True)
    if torch.cuda.is_available():
        assert r.status in (Status.OK, Status.FAIL)
    else:
        assert r.status is Status.SKIP and r.summary.startswith("not checked: ")
        want = ("is built without CUDA" if torch.version.cuda is None else
                "torch sees no CUDA device")
        assert want in r.summary
