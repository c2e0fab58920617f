"""The optional native part of the shm transport: a batch copy (and fused copy+hash) helper.

`_kvhcopy.c` is compiled by `make setup` (or `python -m kvhandoff.transports.shm.native`)
with the system C compiler into the user's cache directory, named by a hash of its source, and
loaded with ctypes when present. Nothing is compiled at import. Without it (no compiler, not
built yet) the map lane copies piece by piece from Python, and the shm transport's status says
so (`native()` gives the reason). The fused hash calls XXH3's streaming API from C: the one the
python-xxhash extension exports (with its SIMD dispatch), else the system's libxxhash.so.0
(Debian package libxxhash0); without either a checksummed write hashes each piece in Python
(source before, destination after its copy). `copy` is the plain batch copy; `copy_regions`
hashes each source piece before copying it and the destination piece right after (the
writer's verification, fused), for a job of one or several regions in one call, a digest pair
per region.

The helper is code this process runs, so it is loaded only from a place no other user could
have written: the file and the two directories kvhandoff made for it (``kvhandoff/native``
under the cache directory) must be owned by this user (or root) and writable by nobody else,
and the cache directory itself owned by this user or root and not world-writable. The file is
opened without following a symbolic link, checked on that descriptor, and loaded through it
(``/proc/self/fd``), so what was checked is what is loaded. A helper that fails the check is
not loaded: the map lane copies from Python, the reason is logged once as a warning and shown
in the shm transport's status and by ``kvhandoff doctor`` (native_copy).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import hashlib
import logging
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger("kvhandoff.transport")

_SOURCE = Path(__file__).with_name("_kvhcopy.c")


def _cache_base() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")


def _target() -> Path:
    digest = hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:16]
    return _cache_base() / "kvhandoff" / "native" / f"libkvhcopy-{digest}.so"


def _unsafe(st: os.stat_result, what: Path, *, strict: bool = True) -> str | None:
    """Why `what` (its stat `st`) is no safe place for code this process loads, or None."""
    if st.st_uid not in (os.geteuid(), 0):
        return f"{what} is owned by uid {st.st_uid}, not this user ({os.geteuid()}) or root"
    mode = stat.S_IMODE(st.st_mode)
    if strict and mode & 0o022:
        return f"{what} is writable by its group or others (mode {mode:o})"
    if not strict and mode & 0o002 and not mode & stat.S_ISVTX:
        return f"{what} is world-writable (mode {mode:o})"
    return None


def check_place(path: Path) -> str | None:
    """Why the helper at `path` may not be loaded (ownership, permissions, a symbolic link), or
    None when its file and directories are safe. Does not open the file."""
    try:
        st = os.lstat(path)
    except OSError as e:
        return f"{path}: {e.strerror}"
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISREG(st.st_mode):
        return f"{path} is not a regular file (a symbolic link is not followed)"
    return _unsafe(st, path) or _check_dirs(path)


def _check_dirs(path: Path) -> str | None:
    dirs = [(path.parent, True), (path.parent.parent, True), (path.parent.parent.parent, False)]
    for d, strict in dirs:
        try:
            st = os.lstat(d)
        except OSError as e:
            return f"{d}: {e.strerror}"
        if not stat.S_ISDIR(st.st_mode):
            return f"{d} is not a directory (a symbolic link is not followed)"
        why = _unsafe(st, d, strict=strict)
        if why is not None:
            return why
    return None


def build() -> Path:
    """Compiles the helper (cc -O2 -shared) into a directory only this user may write; returns
    its path. Raises OSError/CalledProcessError."""
    out = _target()
    out.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    for d in (out.parent.parent, out.parent):  # made by an older version, or by a umask
        if os.lstat(d).st_uid == os.geteuid():
            os.chmod(d, stat.S_IMODE(os.lstat(d).st_mode) & ~0o022)
    cc = os.environ.get("CC", "cc")
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(tmp), str(_SOURCE)], check=True,
                   capture_output=True, text=True)
    os.replace(tmp, out)
    return out


class Native:
    """The loaded helper (`copy`: the batch copy; `copy_regions`: the fused copy and hashes,
    region by region; `hash`: a read-back of pieces) and libxxhash's streaming API (`xxh`, None
    if missing)."""

    def __init__(self, lib: Any, xxh: Any) -> None:
        self.copy = lib.kvh_copy
        self.copy.restype = None
        self.copy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        self.hash = lib.kvh_hash
        self.hash.restype = ctypes.c_int
        self.hash.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                              ctypes.c_void_p]
        self.copy_regions = lib.kvh_copy_regions
        self.copy_regions.restype = ctypes.c_int
        self.copy_regions.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [
            ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 7
        self.xxh = xxh
        self.update_fn: int | None = None
        self.reset_fn: int | None = None
        self.digest_fn: int | None = None
        self._local = threading.local()
        if xxh is not None:
            xxh.XXH3_createState.restype = ctypes.c_void_p
            xxh.XXH3_freeState.argtypes = [ctypes.c_void_p]
            xxh.XXH3_64bits_reset.argtypes = [ctypes.c_void_p]
            xxh.XXH3_64bits_digest.argtypes = [ctypes.c_void_p]
            xxh.XXH3_64bits_digest.restype = ctypes.c_uint64
            # python-xxhash's build has the runtime-dispatched (SIMD) update as well
            update = getattr(xxh, "XXH3_64bits_update_dispatch", None) or xxh.XXH3_64bits_update
            self.update_fn = ctypes.cast(update, ctypes.c_void_p).value
            self.reset_fn = ctypes.cast(xxh.XXH3_64bits_reset, ctypes.c_void_p).value
            self.digest_fn = ctypes.cast(xxh.XXH3_64bits_digest, ctypes.c_void_p).value

    def new_hash(self) -> int | None:
        """A fresh XXH3-64 state (pointer), None without libxxhash."""
        if self.xxh is None:
            return None
        state = self.xxh.XXH3_createState()
        self.xxh.XXH3_64bits_reset(state)
        return int(state)

    def digest(self, state: int) -> int:
        value = int(self.xxh.XXH3_64bits_digest(state))
        self.xxh.XXH3_freeState(state)
        return value

    def states(self) -> tuple[int, int] | None:
        """This thread's pair of XXH3-64 states for `copy_regions` (which resets them), made
        on its first use and freed when the thread ends; None without libxxhash."""
        if self.xxh is None:
            return None
        pair: _States | None = getattr(self._local, "pair", None)
        if pair is None:
            pair = self._local.pair = _States(self.xxh)
        return pair.src, pair.landed


class _States:
    """Two XXH3 states of one thread (freed with the thread's local storage)."""

    def __init__(self, xxh: Any) -> None:
        self._free = xxh.XXH3_freeState
        self.src = int(xxh.XXH3_createState())
        self.landed = int(xxh.XXH3_createState())

    def __del__(self) -> None:
        self._free(self.src)
        self._free(self.landed)


@functools.cache
def native() -> tuple[Native | None, str]:
    """(the helper or None, a one-line description of what the map lane copies with)."""
    path = _target()
    if not path.exists():
        return None, ("native copy helper not built (make setup, or python -m "
                      "kvhandoff.transports.shm.native): per-piece copies from Python")
    why = check_place(path)
    fd = -1
    if why is None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            st = os.fstat(fd)
            why = (f"{path} is not a regular file" if not stat.S_ISREG(st.st_mode)
                   else _unsafe(st, path))
        except OSError as e:
            why = f"{path}: {e.strerror}"
    if why is not None:
        if fd >= 0:
            os.close(fd)
        log.warning("native copy helper NOT loaded: %s; the shm transport copies piece by "
                    "piece from Python (rebuild it: python -m kvhandoff.transports.shm.native)",
                    why)
        return None, f"native copy helper refused ({why}): per-piece copies from Python"
    try:  # through the descriptor checked above: a file swapped since is not what loads
        lib = ctypes.CDLL(f"/proc/self/fd/{fd}")
    except OSError as e:
        return None, f"native copy helper failed to load ({e}): per-piece copies from Python"
    finally:
        os.close(fd)
    xxh, which = _xxhash_library()
    helper = Native(lib, xxh)
    fused = f"fused xxh3 ({which})" if xxh is not None else "no libxxhash: hash in Python"
    return helper, f"native batch copy ({fused})"


def _xxhash_library() -> tuple[Any, str]:
    """The XXH3 streaming API to call from C: the python-xxhash extension's own (a dependency,
    so always there; it exports the API with its runtime SIMD dispatch: measured 3 x the
    system library's generic build on 1 MiB pieces in cache here), else the system's
    libxxhash.so.0; (None, "") without either."""
    try:
        import xxhash._xxhash as ext

        lib = ctypes.CDLL(str(ext.__file__))
        lib.XXH3_createState  # noqa: B018 - raises AttributeError if not exported
        lib.XXH3_64bits_update  # noqa: B018
        return lib, "python-xxhash"
    except (ImportError, OSError, AttributeError):
        pass
    name = ctypes.util.find_library("xxhash") or "libxxhash.so.0"
    try:
        return ctypes.CDLL(name), "libxxhash"
    except OSError:
        return None, ""


def main(argv: list[str] | None = None) -> int:
    """Builds the helper; with `--if-missing` only when no helper of this source is built."""
    args = sys.argv[1:] if argv is None else argv
    if "--if-missing" in args and _target().exists() and check_place(_target()) is None:
        return 0
    try:
        path = build()
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        print(f"kvhandoff: native copy helper not built ({detail.strip()}); the shm transport "
              "copies piece by piece from Python instead", file=sys.stderr)
        return 1
    print(f"kvhandoff: native copy helper built: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
