"""The doctor's UCX and NIXL checks: the real library this process loads, and fake installs
(a fake root with a mapped libucp, a module directory and a ucx_info script)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

from kvhandoff.doctor import Status, check_nixl, check_ucx_lanes, check_ucx_library, ucx_build
from kvhandoff.settings import Settings
from kvhandoff.transports import load_transport

from .fakeroot import fake_ucx

REAL = Path("/")


def test_ucx_library_real_system_is_the_wheel_without_verbs() -> None:
    r = check_ucx_library(REAL, rdma_present=False, require_rdma=False)
    d = r.details
    # the library really mapped in this process, asked for its own version
    maps = Path("/proc/self/maps").read_text()
    assert d["libucp"] and d["libucp"] in maps
    assert d["version"] == importlib.metadata.version("libucx-cu12")
    moddir = Path(d["libucp"]).parent / "ucx"
    has_ib = (moddir / "libuct_ib.so").exists()
    assert d["verbs"] is has_ib
    if not has_ib:  # this machine: the libucx wheel, built --without-verbs --without-rdmacm
        assert "--without-verbs" in d["configure_flags"]
        assert r.status is Status.WARN and "built without verbs" in r.summary
        assert "RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY" in (r.fix or "")
        assert check_ucx_library(REAL, rdma_present=True,
                                 require_rdma=False).status is Status.FAIL
        assert check_ucx_library(REAL, rdma_present=False,
                                 require_rdma=True).status is Status.FAIL


def test_ucx_build_fake_root_with_verbs(tmp_path: Path) -> None:
    flags = "--prefix=/opt/ucx --with-verbs --with-rdmacm --with-cuda=/usr/local/cuda"
    libucp = fake_ucx(tmp_path, modules=("ib", "rdmacm", "cma", "cuda"), flags=flags)
    b = ucx_build(tmp_path)
    assert b.libucp == libucp and b.libucs == "/opt/ucx/lib/libucs.so.0"
    assert b.version == "1.18.0" and b.configure_flags == flags
    assert (b.verbs, b.rdmacm, b.cuda) == (True, True, True)
    assert b.ucx_info == str(tmp_path / "opt/ucx/bin/ucx_info")
    r = check_ucx_library(tmp_path, rdma_present=True, require_rdma=True)
    assert r.status is Status.OK, r
    assert "UCX 1.18.0 at /opt/ucx/lib/libucp.so.0 (verbs=yes, rdmacm=yes, cuda=yes)" == r.summary


def test_ucx_build_fake_root_without_verbs(tmp_path: Path) -> None:
    fake_ucx(tmp_path, modules=("cma",), flags="--without-verbs --without-rdmacm",
             have_cuda=False)
    b = ucx_build(tmp_path)
    assert (b.verbs, b.rdmacm, b.cuda) == (False, False, False)
    assert check_ucx_library(tmp_path, rdma_present=False,
                             require_rdma=False).status is Status.WARN
    r = check_ucx_library(tmp_path, rdma_present=True, require_rdma=False)
    assert r.status is Status.FAIL and "HCA on this node is unusable" in r.summary


def test_ucx_build_fake_root_verbs_without_rdmacm(tmp_path: Path) -> None:
    fake_ucx(tmp_path, modules=("ib", "cma"), flags="--with-verbs --without-rdmacm")
    r = check_ucx_library(tmp_path, rdma_present=True, require_rdma=True)
    assert r.status is Status.WARN and "without rdmacm" in r.summary


def test_ucx_build_fake_root_modules_only(tmp_path: Path) -> None:
    fake_ucx(tmp_path, modules=("ib", "rdmacm"), flags="x")
    (tmp_path / "opt/ucx/bin/ucx_info").unlink()
    b = ucx_build(tmp_path)
    assert b.verbs and b.rdmacm and b.version is None and b.ucx_info is None
    assert any("no ucx_info" in n for n in b.notes)


def test_ucx_build_fake_root_nothing_mapped(tmp_path: Path) -> None:
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/maps").write_text("")
    r = check_ucx_library(tmp_path, rdma_present=False, require_rdma=False)
    assert r.status is Status.FAIL and "no libucp is mapped" in r.summary


def test_ucx_lanes_real_loopback() -> None:
    r = check_ucx_lanes(rdma_present=False, require_rdma=False)
    t = load_transport("ucx", Settings(transport="ucx"))
    try:
        resources = list(t.status().lanes)
    finally:
        t.close()
    assert r.details["resources"] == resources
    same = r.details["same_host"]
    assert same["lanes"]  # a loopback endpoint always has lanes
    rdma = [x for x in resources if not x.startswith(("self/", "tcp/", "sysv/", "posix/",
                                                      "cma/", "xpmem/", "knem/", "cuda"))]
    assert r.details["rdma_resources"] == rdma
    if not rdma:  # this machine
        assert r.status is Status.WARN and "no RDMA lane" in r.summary
        assert check_ucx_lanes(rdma_present=False, require_rdma=True).status is Status.FAIL
        assert check_ucx_lanes(rdma_present=True, require_rdma=False).status is Status.FAIL
    for lane in same["lanes"] + r.details["error_handling"]["lanes"]:
        assert lane in r.summary


def test_nixl_real_system() -> None:
    """NIXL is the nixl-cu12 wheel (module nixl_cu12): loaded as the transport loads it, its
    bundled UCX build named with its verbs modules and the RDMA lanes found here."""
    r = check_nixl()
    if importlib.util.find_spec("nixl_cu12") is None:
        assert r.status is Status.SKIP and "not installed" in r.summary
    else:
        assert r.status is Status.INFO, r.summary
        assert r.details["version"] == importlib.metadata.version("nixl-cu12")
        assert f"bundled UCX {r.details['ucx_version']}" in r.summary
        assert r.details["ucx_version"] != "?" and "RDMA lanes here:" in r.summary
        assert any(x.startswith("tcp/") for x in r.details["resources"])
