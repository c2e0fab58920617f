"""The shm transport's native copy helper: built, loadable from a safe place, or why not.

Rules: the same decision the transport takes when it first copies (`transports.shm.native`):
a helper whose file or directories another user could have written is not loaded (WARN: the
map lane copies from Python, slower); one not built is INFO; a loaded one is OK.
"""

from __future__ import annotations

from .model import CheckResult, Status


def check_native_copy() -> CheckResult:
    """Whether the shm map lane copies with the native helper, and if not why."""
    from kvhandoff.transports.shm import native as shm_native

    path = shm_native._target()
    if not path.exists():
        return CheckResult("native_copy", Status.INFO, f"not built ({path}): the shm transport "
                           "copies piece by piece from Python", details={"path": str(path)})
    why = shm_native.check_place(path)
    if why is not None:
        return CheckResult("native_copy", Status.WARN, f"refused: {why}; the shm transport "
                           "copies piece by piece from Python", details={"path": str(path)},
                           fix="python -m kvhandoff.transports.shm.native (rebuilds it in a "
                           "directory only this user may write)")
    helper, what = shm_native.native()
    if helper is None:
        return CheckResult("native_copy", Status.WARN, what, details={"path": str(path)},
                           fix="python -m kvhandoff.transports.shm.native")
    return CheckResult("native_copy", Status.OK, f"{what}: {path}", details={"path": str(path)})
