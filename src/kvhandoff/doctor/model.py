"""What one doctor check reports: a status, a one-line finding, details and a one-line fix."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class Status(str, enum.Enum):
    """Outcome of one check. Only FAIL is blocking (``kvhandoff doctor`` exits 1)."""

    OK = "ok"
    INFO = "info"  # a fact worth knowing, nothing to fix
    WARN = "warn"  # works, but slower or less safe than it could be
    FAIL = "fail"  # blocking: the node should not go live like this
    SKIP = "skip"  # the check does not apply here; the summary says why

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class CheckResult:
    """One check's report. `fix` is one line, set whenever status is WARN or FAIL."""

    name: str
    status: Status
    summary: str
    details: dict[str, Any] = field(default_factory=dict)
    fix: str | None = None

    def __post_init__(self) -> None:
        if self.status in (Status.WARN, Status.FAIL) and not self.fix:
            raise ValueError(f"doctor check {self.name!r}: a {self.status} result needs a fix")

    @property
    def blocking(self) -> bool:
        return self.status is Status.FAIL

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status.value, "blocking": self.blocking,
                "summary": self.summary, "fix": self.fix, "details": self.details}
