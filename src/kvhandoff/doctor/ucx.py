"""UCX checks: which library this process really loaded (path, version, build: verbs, rdmacm,
cuda), the transports/devices it sees and the lanes a loopback endpoint picks; NIXL.

The library is found in ``<root>/proc/self/maps`` after the ucx transport is loaded, its build
from ``ucx_info`` next to it (``<libdir>/../bin/ucx_info``, the libucx wheel's layout, run
against that same library directory) and from the transport modules in ``<libdir>/ucx/``.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import logging
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .model import CheckResult, Status

VERBS_FIX = ("use a UCX built with verbs and rdmacm: install the distro/DOCA UCX and set "
             "RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true (the libucx wheel is built without them)")


@dataclass
class UcxBuild:
    """What is known about the loaded UCX library."""

    libucp: str | None = None
    libucs: str | None = None
    version: str | None = None
    configure_flags: str | None = None
    uct_modules: set[str] = field(default_factory=set)  # from ucx_info -b and <libdir>/ucx
    have_cuda: bool | None = None
    ucx_info: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def verbs(self) -> bool:
        return "ib" in self.uct_modules and "--without-verbs" not in (self.configure_flags or "")

    @property
    def rdmacm(self) -> bool:
        return "rdmacm" in self.uct_modules and "--without-rdmacm" not in (
            self.configure_flags or "")

    @property
    def cuda(self) -> bool:
        return bool(self.have_cuda) or "cuda" in self.uct_modules

    def to_json(self) -> dict[str, Any]:
        return {"libucp": self.libucp, "libucs": self.libucs, "version": self.version,
                "configure_flags": self.configure_flags, "verbs": self.verbs,
                "rdmacm": self.rdmacm, "cuda": self.cuda,
                "uct_modules": sorted(self.uct_modules), "ucx_info": self.ucx_info,
                "notes": self.notes}


def loaded_libraries(root: Path) -> dict[str, str]:
    """{'libucp': path, 'libucs': path} from <root>/proc/self/maps (what is really mapped)."""
    out: dict[str, str] = {}
    try:
        text = (root / "proc/self/maps").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 6:
            continue
        path = parts[-1]
        name = os.path.basename(path)
        for lib in ("libucp", "libucs"):
            if name.startswith(lib + ".so") and lib not in out:
                out[lib] = path
    return out


def _parse_ucx_info(version_text: str, build_text: str, b: UcxBuild) -> None:
    for line in version_text.splitlines():
        if "Library version:" in line:
            b.version = b.version or line.split(":", 1)[1].strip()
        elif "Configured with:" in line:
            b.configure_flags = line.split(":", 1)[1].strip()
    for line in build_text.splitlines():
        parts = line.split(None, 2)
        if len(parts) < 3 or parts[0] != "#define":
            continue
        name, value = parts[1], parts[2].strip().strip('"')
        if name == "HAVE_CUDA":
            b.have_cuda = value == "1"
        elif name == "UCX_CONFIGURE_FLAGS" and not b.configure_flags:
            b.configure_flags = value
        elif name == "uct_MODULES":  # e.g. ":cuda:ib:rdmacm:cma"
            b.uct_modules |= {m for m in value.split(":") if m}


def ucx_build(root: Path) -> UcxBuild:
    """Reads the build of the UCX library mapped in this process (see module comment)."""
    b = UcxBuild()
    libs = loaded_libraries(root)
    b.libucp, b.libucs = libs.get("libucp"), libs.get("libucs")
    if b.libucp is None:
        b.notes.append("no libucp mapped in this process")
        return b
    libdir = Path(b.libucp).parent
    if root != Path("/"):
        libdir = root / str(libdir).lstrip("/")
    try:  # the version of the library actually loaded
        ucp = ctypes.CDLL(str(libdir / os.path.basename(b.libucp)))
        ucp.ucp_get_version_string.restype = ctypes.c_char_p
        raw = ucp.ucp_get_version_string()
        b.version = raw.decode() if raw else None
    except (OSError, AttributeError) as e:
        b.notes.append(f"cannot ask the library its version: {e}")
    moddir = libdir / "ucx"
    if moddir.is_dir():
        for so in moddir.glob("libuct_*.so"):
            b.uct_modules.add(so.name[len("libuct_"):-len(".so")])
    info = libdir.parent / "bin" / "ucx_info"
    if info.is_file() and os.access(info, os.X_OK):
        b.ucx_info = str(info)
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in (str(libdir), env.get("LD_LIBRARY_PATH", "")) if p)
        try:
            v = subprocess.run([str(info), "-v"], capture_output=True, text=True, env=env,
                               timeout=20)
            bb = subprocess.run([str(info), "-b"], capture_output=True, text=True, env=env,
                                timeout=20)
            _parse_ucx_info(v.stdout, bb.stdout, b)
            if v.returncode != 0:
                b.notes.append(f"ucx_info -v exited {v.returncode}: {v.stderr.strip()[:200]}")
        except (OSError, subprocess.TimeoutExpired) as e:
            b.notes.append(f"ucx_info failed: {e}")
    else:
        b.notes.append(f"no ucx_info next to the library ({info}); build flags from the "
                       "module directory only")
    return b


def _load_ucx(stall_s: float) -> tuple[Any, str | None]:
    """A ucx transport (loads the library), or (None, why)."""
    from kvhandoff.errors import TransportError
    from kvhandoff.settings import Settings
    from kvhandoff.transports import load_transport

    try:
        return load_transport("ucx", Settings(transport="ucx", stall_timeout_s=stall_s)), None
    except TransportError as e:
        return None, str(e)


def check_ucx_library(root: Path, *, rdma_present: bool, require_rdma: bool,
                      ucx_is_transport: bool = True) -> CheckResult:
    t, err = _load_ucx(5.0)
    if t is None:
        return CheckResult(
            "ucx", Status.FAIL if ucx_is_transport else Status.WARN,
            f"UCX cannot be loaded: {err}", {"error": err},
            fix="pip install ucxx-cu12 (pulls the libucx wheel), or set KVHANDOFF_TRANSPORT=tcp")
    t.close()
    b = ucx_build(root)
    details = b.to_json()
    if b.libucp is None:
        return CheckResult("ucx", Status.FAIL, "the ucx transport loaded but no libucp is mapped "
                           "in this process", details, fix="reinstall ucxx-cu12/libucx-cu12")
    feats = ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in
                      (("verbs", b.verbs), ("rdmacm", b.rdmacm), ("cuda", b.cuda)))
    summary = f"UCX {b.version or '?'} at {b.libucp} ({feats})"
    if not b.verbs:
        status = Status.FAIL if (rdma_present or require_rdma) else Status.WARN
        why = ("the HCA on this node is unusable" if rdma_present else
               "peers on other hosts will use TCP")
        return CheckResult("ucx", status, f"{summary}: built without verbs: {why}", details,
                           fix=VERBS_FIX)
    if not b.rdmacm:
        return CheckResult("ucx", Status.WARN, f"{summary}: built without rdmacm (RoCE "
                           "connection setup)", details, fix=VERBS_FIX)
    return CheckResult("ucx", Status.OK, summary, details)


def check_ucx_lanes(*, rdma_present: bool, require_rdma: bool) -> CheckResult:
    """Connects two ucx transports in this process: the resources UCX sees, the lanes a
    same-host endpoint picks, and those with peer error handling on (as to another host)."""
    details: dict[str, Any] = {}
    quiet = logging.getLogger("kvhandoff.transfer")  # the same-host warning is expected here
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        return _lanes(details, rdma_present=rdma_present, require_rdma=require_rdma)
    finally:
        quiet.setLevel(level)


def _lanes(details: dict[str, Any], *, rdma_present: bool, require_rdma: bool) -> CheckResult:
    from kvhandoff.errors import TransportError
    from kvhandoff.settings import Settings
    from kvhandoff.transports import load_transport

    for label, eh in (("same_host", False), ("error_handling", True)):
        s = Settings(transport="ucx", stall_timeout_s=5.0, ucx_same_host_error_handling=eh,
                     require_rdma=False)
        try:
            a = load_transport("ucx", s)
        except TransportError as e:
            return CheckResult("ucx_lanes", Status.SKIP, f"UCX not loadable: {e}", details)
        try:
            b = load_transport("ucx", s)
            try:
                details.setdefault("resources", list(a.status().lanes))
                a.connect("doctor-peer", b.address)
                st = a.status()
                details[label] = {"lanes": list(st.lanes), "degraded": st.degraded}
            finally:
                b.close()
        except TransportError as e:
            return CheckResult("ucx_lanes", Status.FAIL, f"a loopback UCX endpoint fails: {e}",
                               details, fix="run with UCX_LOG_LEVEL=info to see why; check "
                               "UCX_TLS/UCX_NET_DEVICES")
        finally:
            a.close()
    res = details.get("resources", [])
    net = [r for r in res if not r.startswith(("self/", "sysv/", "posix/", "cma/", "xpmem/",
                                              "knem/", "cuda"))]
    rdma = [r for r in net if not r.startswith("tcp/")]
    same = ", ".join(details["same_host"]["lanes"]) or "none"
    guarded = ", ".join(details["error_handling"]["lanes"]) or "none"
    summary = (f"resources: {', '.join(res)}; loopback lanes: {same}; with peer error "
               f"handling (as to another host): {guarded}")
    details["rdma_resources"] = rdma
    if rdma_present and not rdma:
        return CheckResult("ucx_lanes", Status.FAIL, f"UCX sees no RDMA resource although the "
                           f"node has an HCA; {summary}", details, fix=VERBS_FIX)
    if not rdma:
        return CheckResult("ucx_lanes", Status.FAIL if require_rdma else Status.WARN,
                           f"no RDMA lane: {summary}", details,
                           fix="see the rdma and ucx checks (device, drivers, UCX build)")
    return CheckResult("ucx_lanes", Status.OK, summary, details)


def check_nixl() -> CheckResult:
    """NIXL (the nixl extra, nixl-cu12, imported as nixl_cu12: the nixl transport and the
    bench baseline): whether it loads the way the transport loads it, and its bundled UCX."""
    if importlib.util.find_spec("nixl_cu12") is None:
        return CheckResult("nixl", Status.SKIP, "NIXL not installed (optional: the nixl "
                           "transport, RDMA from a pip install; pip install 'kvhandoff[nixl]')",
                           {})
    from kvhandoff.errors import TransportError
    from kvhandoff.transports.nixl.lib import nixl_api, nixl_version, ucx_offer

    version = nixl_version()
    try:
        nixl_api()
        offer = ucx_offer()
    except (TransportError, ImportError, OSError) as e:  # a broken install
        return CheckResult("nixl", Status.WARN, f"NIXL {version} installed but does not load: "
                           f"{e}", {"version": version},
                           fix="reinstall nixl-cu12 matching this CUDA, or uninstall it")
    details = {"version": version, "ucx_version": offer.version, "libdir": offer.libdir,
               "verbs_modules": list(offer.verbs_modules), "resources": list(offer.resources),
               "modules": offer.modules_note, "error": offer.error}
    rdma = offer.rdma_tls
    summary = (f"NIXL {version} loads; its bundled UCX {offer.version} has verbs modules "
               f"{', '.join(offer.verbs_modules) or 'none'}; RDMA lanes here: "
               f"{', '.join(rdma) or 'none (tcp only)'}")
    return CheckResult("nixl", Status.INFO if not offer.error else Status.WARN, summary,
                       details)
