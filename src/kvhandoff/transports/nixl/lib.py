# Loading NIXL (the optional `nixl` extra: nixl-cu12, imported as nixl_cu12) for the nixl
# transport, and what its bundled UCX offers (status lanes, degraded reason).
#
# - NIXL's wheel bundles its own UCX (libucp-*.so and the transport modules in
#   nixl_cu12.libs/ucx: tcp, shared memory, cma, ib, ib_mlx5, efa). Its efa module links the
#   system's libefa when rdma-core is installed, which pulls a second libibverbs and libnl into
#   the process; at process exit the two libnl copies crash it (SIGSEGV in rtnl_tc_unregister,
#   reproduced with one agent and no transfer). So, unless the host has an EFA device or the
#   user set UCX_MODULES, the efa module is left out (UCX_MODULES=^efa, before NIXL loads UCX);
#   status names that choice.
# - NIXL's Python logger writes INFO lines to stdout (and turns logging.raiseExceptions off);
#   kvhandoff processes may use stdout for a protocol, so after the import its "nixl" logger
#   propagates to the process's logging instead, at WARNING unless NIXL_LOG_LEVEL is set, and
#   logging.raiseExceptions is restored.
# - The UCX resources are read once per process from a UCP context of that same bundled
#   library (ucp_context_print_info via ctypes): "tl/device" per resource. RDMA lanes are the
#   network transports other than tcp (rc_verbs, rc_mlx5, dc_mlx5, ud_*, srd, ...).
from __future__ import annotations

import ctypes
import glob
import importlib
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvhandoff.errors import TransportError

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'kvhandoff[nixl]' (nixl-cu12)"
_SAME_HOST_TLS = ("self", "sysv", "posix", "cma", "xpmem", "knem")
_lock = threading.Lock()
_api: Any = None
_modules_note = ""
_info: UcxOffer | None = None


def _efa_device() -> bool:
    """Whether this host has an RDMA device driven by efa (AWS)."""
    for drv in glob.glob("/sys/class/infiniband/*/device/driver"):
        if os.path.basename(os.path.realpath(drv)) == "efa":
            return True
    return False


def nixl_api() -> Any:
    """The nixl_cu12._api module (imported once), or TransportError with the install hint."""
    global _api, _modules_note
    with _lock:
        if _api is not None:
            return _api
        if "UCX_MODULES" in os.environ:
            _modules_note = f"UCX_MODULES={os.environ['UCX_MODULES']} (set by the user)"
        elif _efa_device():
            _modules_note = ("efa module loaded (EFA device present; the process may crash at "
                             "exit with two libnl copies, see the nixl transport docs)")
        else:
            os.environ["UCX_MODULES"] = "^efa"
            _modules_note = ("UCX_MODULES=^efa set by kvhandoff (no EFA device; the module's "
                             "system libefa crashes the process at exit)")
        raise_exceptions = logging.raiseExceptions
        try:
            _api = importlib.import_module("nixl_cu12._api")
        except ImportError as e:
            raise TransportError(f"transport 'nixl' needs NIXL: {INSTALL_HINT}; import of "
                                 f"nixl_cu12 failed: {e}") from e
        finally:
            logging.raiseExceptions = raise_exceptions
        nixl_log = logging.getLogger("nixl")
        for handler in list(nixl_log.handlers):
            nixl_log.removeHandler(handler)
        nixl_log.propagate = True
        if not os.environ.get("NIXL_LOG_LEVEL"):
            nixl_log.setLevel(logging.WARNING)
        return _api


def nixl_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("nixl-cu12")
    except metadata.PackageNotFoundError:
        return "?"


@dataclass(frozen=True)
class UcxOffer:
    """What NIXL's bundled UCX offers in this process."""

    version: str
    libdir: str
    verbs_modules: tuple[str, ...]  # ib modules shipped with it (ib, ib_mlx5, efa, ...)
    resources: tuple[str, ...]  # "tl/device" as UCP reports them
    modules_note: str
    error: str = ""

    @property
    def network_tls(self) -> tuple[str, ...]:
        tls = {r.split("/", 1)[0] for r in self.resources}
        return tuple(sorted(t for t in tls if t not in _SAME_HOST_TLS
                            and not t.startswith(("cuda", "gdr", "rocm", "ze"))))

    @property
    def rdma_tls(self) -> tuple[str, ...]:
        return tuple(t for t in self.network_tls if t != "tcp")


def ucx_offer() -> UcxOffer:
    """NIXL's UCX build and resources (probed once per process; NIXL must be loaded)."""
    global _info
    with _lock:
        if _info is None:
            _info = _probe()
        return _info


def _probe() -> UcxOffer:
    import nixl_cu12

    libdir = Path(nixl_cu12.__file__).resolve().parent.parent / "nixl_cu12.libs"
    mods = tuple(sorted(p.name[len("libuct_"):].split(".so")[0]
                        for p in (libdir / "ucx").glob("libuct_ib*.so*")))
    found = sorted(glob.glob(str(libdir / "libucp-*.so*")))
    if not found:
        return UcxOffer("?", str(libdir), mods, (), _modules_note,
                        error=f"no bundled libucp in {libdir}")
    try:
        version, resources = _ucp_resources(found[0])
    except (OSError, AttributeError, RuntimeError) as e:
        return UcxOffer("?", str(libdir), mods, (), _modules_note, error=str(e))
    return UcxOffer(version, str(libdir), mods, resources, _modules_note)


def _ucp_resources(path: str) -> tuple[str, tuple[str, ...]]:
    ucp = ctypes.CDLL(path)  # the library NIXL's UCX plugin loaded (same file, same handle)
    ucp.ucp_get_version_string.restype = ctypes.c_char_p
    version = (ucp.ucp_get_version_string() or b"?").decode()
    major, minor, rel = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_uint()
    ucp.ucp_get_version(ctypes.byref(major), ctypes.byref(minor), ctypes.byref(rel))
    config = ctypes.c_void_p()
    if ucp.ucp_config_read(None, None, ctypes.byref(config)) != 0:
        raise RuntimeError("ucp_config_read failed")
    params = (ctypes.c_uint64 * 64)()  # ucp_params_t: field_mask, features, rest unused
    params[0] = 1  # UCP_PARAM_FIELD_FEATURES
    params[1] = (1 << 0) | (1 << 1)  # UCP_FEATURE_TAG | UCP_FEATURE_RMA
    ctx = ctypes.c_void_p()
    status = ucp.ucp_init_version(major.value, minor.value, params, config, ctypes.byref(ctx))
    ucp.ucp_config_release(config)
    if status != 0:
        raise RuntimeError(f"ucp_init failed with status {status}")
    libc = ctypes.CDLL(None)
    libc.tmpfile.restype = ctypes.c_void_p
    libc.fflush.argtypes = [ctypes.c_void_p]
    libc.fileno.argtypes = [ctypes.c_void_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    ucp.ucp_context_print_info.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    f = libc.tmpfile()
    try:
        if not f:
            raise RuntimeError("tmpfile() failed")
        ucp.ucp_context_print_info(ctx, f)
        libc.fflush(f)
        fd = libc.fileno(f)
        os.lseek(fd, 0, os.SEEK_SET)
        chunks = []
        while part := os.read(fd, 65536):
            chunks.append(part)
        text = b"".join(chunks).decode("utf-8", "replace")
    finally:
        if f:
            libc.fclose(f)
        ucp.ucp_cleanup(ctx)
    return version, parse_resources(text)


def parse_resources(text: str) -> tuple[str, ...]:
    """The "tl/device" ending each `resource N : md M dev D flags XX tl/device` line of
    ucp_context_print_info."""
    out = []
    for line in text.splitlines():
        words = line.lstrip("# ").split()
        if len(words) > 2 and words[0] == "resource" and "flags" in words and "/" in words[-1]:
            out.append(words[-1])
    return tuple(out)
