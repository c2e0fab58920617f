"""The shm copy helper is loaded only from a place no other user could have written: a helper
whose directory is group- or world-writable, whose file another user owns, or which is a
symbolic link is refused; the map lane then copies from Python, and the refusal is logged,
in `native()`'s description (the transport's status) and in doctor's native_copy check.

Each case builds a real helper with the system compiler into its own XDG_CACHE_HOME."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvhandoff.doctor import Status, check_native_copy
from kvhandoff.transports.shm import native as shm_native

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None,
                                reason="no C compiler to build the helper with")


@pytest.fixture
def built(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    shm_native.native.cache_clear()
    path = shm_native.build()
    yield path
    shm_native.native.cache_clear()  # the next user finds the real cache's helper again


def test_a_helper_built_here_loads(built: Path) -> None:
    assert stat_mode(built.parent) & 0o077 == 0  # build() makes its directory private
    helper, what = shm_native.native()
    assert helper is not None and what.startswith("native batch copy"), what
    assert check_native_copy().status is Status.OK


def stat_mode(p: Path) -> int:
    return os.lstat(p).st_mode & 0o777


@pytest.mark.parametrize(("where", "mode"), [("native", 0o777), ("native", 0o770),
                                             ("kvhandoff", 0o757)])
def test_a_writable_directory_is_refused_visibly(built: Path, where: str, mode: int,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    d = built.parent if where == "native" else built.parent.parent
    os.chmod(d, mode)
    caplog.set_level(logging.WARNING, logger="kvhandoff")
    helper, what = shm_native.native()
    assert helper is None
    assert "refused" in what and "writable by its group or others" in what and str(d) in what
    assert any("NOT loaded" in r.getMessage() for r in caplog.records)
    doc = check_native_copy()
    assert doc.status is Status.WARN and str(d) in doc.summary
    shm_native.main(["--if-missing"])  # rebuilding fixes the directory
    shm_native.native.cache_clear()
    assert shm_native.native()[0] is not None


def test_a_world_writable_file_is_refused(built: Path) -> None:
    os.chmod(built, 0o777)
    helper, what = shm_native.native()
    assert helper is None and str(built) in what


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_file_of_another_user_is_refused(built: Path) -> None:
    os.chown(built, 4242, 4242)
    helper, what = shm_native.native()
    assert helper is None and "owned by uid 4242" in what


def test_a_symbolic_link_is_not_followed(built: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere.so"
    built.rename(elsewhere)
    built.symlink_to(elsewhere)
    helper, what = shm_native.native()
    assert helper is None and "symbolic link" in what
