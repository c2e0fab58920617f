"""Node checks that read system files: RDMA devices, locked memory, /dev/shm, ptrace scope
(cross-process memory access), hugepages, NVIDIA devices.

Every function reads through `root` (``Path("/")`` on a real node; a directory laid out like
one in tests), so the same code runs against the real system and against a fake root.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from .model import CheckResult, Status

_GIB = 1 << 30
_SHM_MIN = 1 * _GIB  # below this (Docker's default is 64 MiB) posix shm lanes run out of room

MEMLOCK_FIX = ("raise the locked-memory limit to unlimited: systemd LimitMEMLOCK=infinity, "
               "docker --ulimit memlock=-1, k8s: LimitMEMLOCK=infinity in containerd's unit")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _under(root: Path, absolute: str) -> Path:
    return root / absolute.lstrip("/")


# ---- RDMA -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class RdmaInventory:
    """HCAs in /sys/class/infiniband (with port states) and nodes in /dev/infiniband."""

    devices: dict[str, list[dict[str, str]]]  # name -> [{port, state, link_layer}]
    dev_nodes: list[str]

    @property
    def active_ports(self) -> int:
        return sum(1 for ports in self.devices.values() for p in ports
                   if "ACTIVE" in p["state"].upper())

    @property
    def uverbs(self) -> list[str]:
        return [n for n in self.dev_nodes if n.startswith("uverbs")]


def rdma_inventory(root: Path) -> RdmaInventory:
    devices: dict[str, list[dict[str, str]]] = {}
    sys_ib = _under(root, "/sys/class/infiniband")
    if sys_ib.is_dir():
        for dev in sorted(sys_ib.iterdir()):
            ports = []
            pdir = dev / "ports"
            if pdir.is_dir():
                for p in sorted(pdir.iterdir(), key=lambda x: x.name):
                    ports.append({"port": p.name, "state": _read(p / "state") or "unknown",
                                  "link_layer": _read(p / "link_layer") or "unknown"})
            devices[dev.name] = ports
    dev_ib = _under(root, "/dev/infiniband")
    nodes = sorted(p.name for p in dev_ib.iterdir()) if dev_ib.is_dir() else []
    return RdmaInventory(devices, nodes)


def check_rdma(root: Path, *, require_rdma: bool) -> CheckResult:
    inv = rdma_inventory(root)
    details = {"devices": inv.devices, "dev_infiniband": inv.dev_nodes,
               "require_rdma": require_rdma}
    miss = Status.FAIL if require_rdma else Status.WARN
    if not inv.devices and not inv.dev_nodes:
        return CheckResult(
            "rdma", miss, "no RDMA device: no /sys/class/infiniband entry, no /dev/infiniband; "
            "peers on other hosts will use TCP", details,
            fix="on an RDMA node: pass the HCA in (k8s RDMA device plugin resource, docker "
                "--device /dev/infiniband) and install libibverbs1 ibverbs-providers librdmacm1")
    if inv.devices and not inv.uverbs:
        return CheckResult(
            "rdma", miss, f"HCA(s) {', '.join(inv.devices)} in sysfs but no "
            "/dev/infiniband/uverbs* node: this process cannot open them", details,
            fix="expose /dev/infiniband to the process (k8s RDMA device plugin resource, docker "
                "--device /dev/infiniband, systemd PrivateDevices=no)")
    if not inv.devices:
        return CheckResult(
            "rdma", miss, f"/dev/infiniband has {', '.join(inv.dev_nodes)} but "
            "/sys/class/infiniband lists no HCA", details,
            fix="mount the host's /sys (read-only) or check that the HCA driver (mlx5_ib) is "
                "loaded on the host")
    ports = "; ".join(f"{d} port {p['port']} {p['state']} ({p['link_layer']})"
                      for d, ps in inv.devices.items() for p in ps) or "no ports listed"
    if inv.active_ports == 0:
        return CheckResult("rdma", miss, f"no active RDMA port: {ports}", details,
                           fix="bring a port up (cable, switch, subnet manager; "
                               "`ibv_devinfo` shows state: PORT_ACTIVE)")
    rdma_cm = "rdma_cm" in inv.dev_nodes
    return CheckResult("rdma", Status.OK,
                       f"{ports}; nodes: {', '.join(inv.dev_nodes)}"
                       + ("" if rdma_cm else " (no rdma_cm: UCX rdmacm wireup unavailable)"),
                       details)


# ---- locked memory --------------------------------------------------------------------------

def memlock_limit(root: Path) -> tuple[int | None, int | None] | None:
    """(soft, hard) locked-memory limit in bytes from <root>/proc/self/limits; None means
    unlimited; the whole result is None when the file cannot be read."""
    text = _read(_under(root, "/proc/self/limits"))
    if text is None:
        return None
    for line in text.splitlines():
        if line.startswith("Max locked memory"):
            parts = line[len("Max locked memory"):].split()
            if len(parts) < 2:
                return None

            def val(s: str) -> int | None:
                return None if s == "unlimited" else int(s)

            try:
                return val(parts[0]), val(parts[1])
            except ValueError:
                return None
    return None


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "unlimited"
    for unit, size in (("GiB", _GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}".replace(".0 ", " ")
    return f"{n} B"


def check_memlock(root: Path, *, rdma_present: bool, require_rdma: bool) -> CheckResult:
    lim = memlock_limit(root)
    if lim is None:
        return CheckResult("memlock", Status.WARN, "cannot read the locked-memory limit "
                           "(/proc/self/limits)", {}, fix="run `ulimit -l` in the engine's "
                           "environment: it must print unlimited for RDMA")
    soft, hard = lim
    details = {"soft_bytes": soft, "hard_bytes": hard}
    if soft is None:
        return CheckResult("memlock", Status.OK, "locked memory: unlimited", details)
    status = Status.FAIL if (rdma_present or require_rdma) else Status.WARN
    why = ("RDMA registration pins the KV buffers and will fail" if status is Status.FAIL else
           "no RDMA here, but RDMA registration would fail with it")
    return CheckResult("memlock", status, f"locked memory limited to {_fmt_bytes(soft)} "
                       f"(hard {_fmt_bytes(hard)}): {why}", details, fix=MEMLOCK_FIX)


# ---- /dev/shm -------------------------------------------------------------------------------

def check_shm(root: Path) -> CheckResult:
    path = _under(root, "/dev/shm")
    fix = ("give /dev/shm room: docker --shm-size=16g, k8s an emptyDir {medium: Memory} "
           "mounted at /dev/shm")
    try:
        st = os.statvfs(path)
    except OSError as e:
        return CheckResult("shm", Status.WARN, f"/dev/shm unavailable ({e.strerror}): UCX "
                           "posix shared-memory lanes cannot work", {"path": str(path)}, fix=fix)
    size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    details = {"path": str(path), "size_bytes": size, "free_bytes": free}
    if size < _SHM_MIN:
        return CheckResult("shm", Status.WARN, f"/dev/shm is only {_fmt_bytes(size)} "
                           f"({_fmt_bytes(free)} free): same-host shared-memory lanes run short",
                           details, fix=fix)
    return CheckResult("shm", Status.OK,
                       f"/dev/shm {_fmt_bytes(size)} ({_fmt_bytes(free)} free)", details)


# ---- cross-process memory access ------------------------------------------------------------

_PTRACE_MEANING = {
    0: "classic: same-user processes may read each other's memory",
    1: "restricted: only a process's descendants (or a declared tracer) may read its memory",
    2: "admin-only: CAP_SYS_PTRACE needed",
    3: "disabled until reboot",
}


def cross_process_probe(timeout_s: float = 20.0) -> tuple[bool, str]:
    """Two sibling processes: one holds a pattern, the other reads it with process_vm_readv
    (UCX cma). (True, how) when the bytes arrive intact, else (False, why)."""
    cmd = [sys.executable, "-m", "kvhandoff.doctor._xproc"]
    holder = subprocess.Popen([*cmd, "hold"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout is not None and holder.stdin is not None
        line = holder.stdout.readline().split()
        if len(line) != 3:
            return False, "the holder process did not start"
        pid, addr, length = line
        try:
            out = subprocess.run([*cmd, "read", pid, addr, length], capture_output=True,
                                 text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return False, f"the reader did not answer within {timeout_s:g} s"
        answer = out.stdout.strip()
        from ._xproc import PATTERN
        if answer == PATTERN.hex():
            return True, "process_vm_readv between sibling processes works"
        if answer.startswith("error"):
            return False, f"process_vm_readv between sibling processes refused: {answer[6:]}"
        return False, f"process_vm_readv returned wrong bytes or failed: {answer or out.stderr!r}"
    finally:
        if holder.stdin is not None:
            try:
                holder.stdin.write("\n")
                holder.stdin.close()
            except OSError:
                pass
        try:
            holder.wait(timeout=5)
        except subprocess.TimeoutExpired:
            holder.kill()
            holder.wait()


def check_ptrace(root: Path, *, probe: bool) -> CheckResult:
    raw = _read(_under(root, "/proc/sys/kernel/yama/ptrace_scope"))
    scope: int | None
    try:
        scope = int(raw) if raw is not None else None
    except ValueError:
        scope = None
    meaning = ("Yama LSM absent: same-user processes may read each other's memory"
               if raw is None else _PTRACE_MEANING.get(scope if scope is not None else -1,
                                                       f"unknown value {raw!r}"))
    details: dict[str, object] = {"ptrace_scope": scope, "meaning": meaning}
    fix = ("sysctl -w kernel.yama.ptrace_scope=0 (or give the engines CAP_SYS_PTRACE); "
           "else UCX drops cma and same-host copies go through shared-memory bounce buffers")
    works: bool | None = None
    if probe:
        works, how = cross_process_probe()
        details["probe"] = how
        details["probe_ok"] = works
    if works is False:
        return CheckResult("cross_process_memory", Status.WARN, f"{how} (ptrace_scope: "
                           f"{meaning})", details, fix=fix)
    if scope is not None and scope != 0 and works is None:
        return CheckResult("cross_process_memory", Status.WARN, f"ptrace_scope={scope}: "
                           f"{meaning}", details, fix=fix)
    summary = f"ptrace_scope: {meaning}" if scope is None else f"ptrace_scope={scope}: {meaning}"
    if works:
        summary += "; sibling-process read (cma) works"
    return CheckResult("cross_process_memory", Status.OK, summary, details)


# ---- hugepages ------------------------------------------------------------------------------

def check_hugepages(root: Path) -> CheckResult:
    pools: dict[str, dict[str, int | None]] = {}
    base = _under(root, "/sys/kernel/mm/hugepages")
    if base.is_dir():
        for d in sorted(base.iterdir()):
            if d.name.startswith("hugepages-"):
                def num(name: str, d: Path = d) -> int | None:
                    v = _read(d / name)
                    return int(v) if v is not None and v.isdigit() else None
                pools[d.name[len("hugepages-"):]] = {"total": num("nr_hugepages"),
                                                     "free": num("free_hugepages")}
    thp_raw = _read(_under(root, "/sys/kernel/mm/transparent_hugepage/enabled"))
    thp = None
    if thp_raw and "[" in thp_raw:
        thp = thp_raw.split("[", 1)[1].split("]", 1)[0]
    details = {"pools": pools, "transparent_hugepage": thp}
    if not pools and thp is None:
        return CheckResult("hugepages", Status.INFO, "no hugepage information in /sys", details)
    parts = [f"{size}: {p['total']} reserved, {p['free']} free" for size, p in pools.items()]
    parts.append(f"transparent hugepages: {thp or 'unknown'}")
    return CheckResult("hugepages", Status.INFO, "; ".join(parts) + " (not required)", details)


# ---- NVIDIA devices (files only; torch is asked in cuda.py) ---------------------------------

def nvidia_inventory(root: Path) -> dict[str, object]:
    gpus: dict[str, str] = {}
    base = _under(root, "/proc/driver/nvidia/gpus")
    if base.is_dir():
        for d in sorted(base.iterdir()):
            info = _read(d / "information") or ""
            model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines()
                          if ln.startswith("Model:")), "unknown model")
            gpus[d.name] = model
    dev = _under(root, "/dev")
    nodes = sorted(p.name for p in dev.glob("nvidia[0-9]*")) if dev.is_dir() else []
    driver = _read(_under(root, "/proc/driver/nvidia/version"))
    return {"gpus": gpus, "dev_nodes": nodes,
            "driver": driver.splitlines()[0] if driver else None}
