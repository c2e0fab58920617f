"""The mutation run of the protocol's release rules (`scripts/mutate_release_rules.py`): each
mutant of `protocol/roomstate.py`, `rooms.py` and `inflight.py`, and of a woken agent's recheck
(`peers.py`, `peerstate.py`, `receive.py`), is killed by the simulator's seeds 0-1999, or is a
survivor docs/RELIABILITY.md explains. The run is `long` (several
minutes: each survivor runs every seed); that every mutant still applies to today's code is
checked in `make test`."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "mutate_release_rules.py"


def script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mutate_release_rules", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_every_mutant_still_applies_once_and_every_expected_survivor_is_one() -> None:
    mod = script()
    names = [m.name for m in mod.MUTANTS]
    assert len(names) == len(set(names))
    for m in mod.MUTANTS:
        text = (ROOT / "src" / mod.PROTO / m.file).read_text()
        assert text.count(m.old) == 1, f"{m.name}: its text is not once in {m.file}"
        assert m.old != m.new
    listed = {**mod.EQUIVALENT, **mod.SIM_GAPS}
    assert set(listed) <= set(names)
    doc = (ROOT / "docs" / "RELIABILITY.md").read_text()
    for name in listed:
        assert f"`{name}`" in doc, f"docs/RELIABILITY.md does not explain survivor {name}"


@pytest.mark.long
@pytest.mark.timeout(7200)
def test_every_release_rule_mutant_is_killed_or_explained() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--seeds", "2000"], cwd=ROOT,
                          capture_output=True, text=True, timeout=7000)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]


def test_no_leg_has_two_ops_of_one_tag_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    """Why `one-completion-clears-the-tag` survives as an equivalent mutant: over the
    simulator's seeds no leg ever posts an op of a data tag while another op of that tag is
    in flight, so a tag's count in the fence never exceeds 1 and clearing it on one
    completion changes nothing."""
    from kvhandoff.protocol.roomstate import Fence
    from kvhandoff.testing.simulator import run_seed

    posted = Fence.posted
    seen: list[int] = []

    def checked(self: Fence, tags: object) -> None:
        seen.extend(t for t in tags if self.tags.get(t))  # type: ignore[attr-defined]
        posted(self, tags)  # type: ignore[arg-type]

    monkeypatch.setattr(Fence, "posted", checked)
    for seed in range(300):
        run_seed(seed)
    assert seen == []
