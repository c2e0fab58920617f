"""The doctor's file-reading checks, on the real system and on fake roots."""

from __future__ import annotations

import os
import resource
from pathlib import Path

import pytest

from kvhandoff.doctor import (
    Status,
    check_hugepages,
    check_memlock,
    check_ptrace,
    check_rdma,
    check_shm,
    rdma_inventory,
)
from kvhandoff.doctor.system import cross_process_probe, memlock_limit

from .fakeroot import limits, put, rdma_node

REAL = Path("/")


# ---- RDMA -----------------------------------------------------------------------------------

def test_rdma_real_system_matches_sysfs_and_dev() -> None:
    inv = rdma_inventory(REAL)
    sys_ib, dev_ib = Path("/sys/class/infiniband"), Path("/dev/infiniband")
    assert sorted(inv.devices) == (sorted(os.listdir(sys_ib)) if sys_ib.is_dir() else [])
    assert inv.dev_nodes == (sorted(os.listdir(dev_ib)) if dev_ib.is_dir() else [])
    if not inv.devices and not inv.dev_nodes:  # this machine: no RDMA at all
        r = check_rdma(REAL, require_rdma=False)
        assert r.status is Status.WARN and "no RDMA device" in r.summary and r.fix
        assert check_rdma(REAL, require_rdma=True).status is Status.FAIL


def test_rdma_fake_root_active_port_is_ok(tmp_path: Path) -> None:
    rdma_node(tmp_path)
    r = check_rdma(tmp_path, require_rdma=True)
    assert r.status is Status.OK, r
    assert "mlx5_0 port 1 4: ACTIVE (InfiniBand)" in r.summary
    assert r.details["dev_infiniband"] == ["rdma_cm", "uverbs0"]


def test_rdma_fake_root_no_uverbs_node_is_reported(tmp_path: Path) -> None:
    rdma_node(tmp_path, uverbs=False, rdma_cm=False)
    r = check_rdma(tmp_path, require_rdma=False)
    assert r.status is Status.WARN and "no /dev/infiniband/uverbs" in r.summary
    assert check_rdma(tmp_path, require_rdma=True).status is Status.FAIL


def test_rdma_fake_root_port_down_and_no_rdma_cm(tmp_path: Path) -> None:
    rdma_node(tmp_path, state="1: DOWN")
    r = check_rdma(tmp_path, require_rdma=True)
    assert r.status is Status.FAIL and "no active RDMA port" in r.summary
    rdma_node(tmp_path, state="4: ACTIVE")
    (tmp_path / "dev/infiniband/rdma_cm").unlink()
    r = check_rdma(tmp_path, require_rdma=True)
    assert r.status is Status.OK and "no rdma_cm" in r.summary


def test_rdma_fake_root_empty_is_missing(tmp_path: Path) -> None:
    r = check_rdma(tmp_path, require_rdma=False)
    assert r.status is Status.WARN and r.details["devices"] == {}


# ---- memlock --------------------------------------------------------------------------------

def test_memlock_real_system_matches_getrlimit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)

    def conv(v: int) -> int | None:
        return None if v == resource.RLIM_INFINITY else v

    assert memlock_limit(REAL) == (conv(soft), conv(hard))
    r = check_memlock(REAL, rdma_present=False, require_rdma=False)
    assert (r.status is Status.OK) == (soft == resource.RLIM_INFINITY)
    if soft != resource.RLIM_INFINITY:
        assert r.status is Status.WARN and "LimitMEMLOCK=infinity" in (r.fix or "")
        assert check_memlock(REAL, rdma_present=True, require_rdma=False).status is Status.FAIL


def test_memlock_fake_root(tmp_path: Path) -> None:
    put(tmp_path, "/proc/self/limits", limits("unlimited"))
    assert check_memlock(tmp_path, rdma_present=True, require_rdma=True).status is Status.OK
    put(tmp_path, "/proc/self/limits", limits("65536", "unlimited"))
    assert memlock_limit(tmp_path) == (65536, None)
    r = check_memlock(tmp_path, rdma_present=True, require_rdma=False)
    assert r.status is Status.FAIL and "64 KiB" in r.summary and "hard unlimited" in r.summary
    assert check_memlock(tmp_path, rdma_present=False, require_rdma=False).status is Status.WARN


def test_memlock_fake_root_unreadable(tmp_path: Path) -> None:
    r = check_memlock(tmp_path, rdma_present=False, require_rdma=False)
    assert r.status is Status.WARN and "cannot read" in r.summary


# ---- /dev/shm -------------------------------------------------------------------------------

def test_shm_real_system_size() -> None:
    r = check_shm(REAL)
    if not Path("/dev/shm").is_dir():
        assert r.status is Status.WARN
        return
    st = os.statvfs("/dev/shm")
    assert r.details["size_bytes"] == st.f_blocks * st.f_frsize
    assert (r.status is Status.OK) == (r.details["size_bytes"] >= 1 << 30)


def test_shm_fake_root(tmp_path: Path) -> None:
    r = check_shm(tmp_path)
    assert r.status is Status.WARN and "unavailable" in r.summary and "--shm-size" in (r.fix or "")
    (tmp_path / "dev/shm").mkdir(parents=True)
    r = check_shm(tmp_path)
    st = os.statvfs(tmp_path)
    assert r.details["size_bytes"] == st.f_blocks * st.f_frsize
    assert r.details["path"] == str(tmp_path / "dev/shm")


# ---- cross-process memory access ------------------------------------------------------------

def test_ptrace_real_system_and_sibling_probe() -> None:
    scope_file = Path("/proc/sys/kernel/yama/ptrace_scope")
    scope = int(scope_file.read_text()) if scope_file.exists() else None
    r = check_ptrace(REAL, probe=True)
    assert r.details["ptrace_scope"] == scope
    assert isinstance(r.details["probe_ok"], bool)
    assert (r.status is Status.OK) == r.details["probe_ok"]
    if scope in (None, 0):  # classic permissions: sibling processes of one user may read
        ok, how = cross_process_probe()
        assert ok, how


@pytest.mark.parametrize(("raw", "status"), [("0", Status.OK), ("1", Status.WARN),
                                              ("2", Status.WARN), ("3", Status.WARN)])
def test_ptrace_fake_root(tmp_path: Path, raw: str, status: Status) -> None:
    put(tmp_path, "/proc/sys/kernel/yama/ptrace_scope", raw + "\n")
    r = check_ptrace(tmp_path, probe=False)
    assert r.status is status and r.details["ptrace_scope"] == int(raw)
    if status is Status.WARN:
        assert "ptrace_scope=0" in (r.fix or "")


def test_ptrace_fake_root_without_yama(tmp_path: Path) -> None:
    r = check_ptrace(tmp_path, probe=False)
    assert r.status is Status.OK and "Yama LSM absent" in r.summary


# ---- hugepages ------------------------------------------------------------------------------

def test_hugepages_real_system() -> None:
    r = check_hugepages(REAL)
    base = Path("/sys/kernel/mm/hugepages")
    want = sorted(p.name[len("hugepages-"):] for p in base.iterdir()) if base.is_dir() else []
    assert sorted(r.details["pools"]) == want
    for size, pool in r.details["pools"].items():
        assert pool["total"] == int((base / f"hugepages-{size}/nr_hugepages").read_text())
    assert r.status is Status.INFO


def test_hugepages_fake_root(tmp_path: Path) -> None:
    put(tmp_path, "/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages", "512\n")
    put(tmp_path, "/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages", "100\n")
    put(tmp_path, "/sys/kernel/mm/transparent_hugepage/enabled", "always [madvise] never\n")
    r = check_hugepages(tmp_path)
    assert r.details == {"pools": {"2048kB": {"total": 512, "free": 100}},
                         "transparent_hugepage": "madvise"}
    assert "2048kB: 512 reserved, 100 free" in r.summary
