"""The shared rules for building native code (marin.nativebuild); the kernels' own tests build for real."""

from __future__ import annotations

from pathlib import Path

import pytest

from marin import nativebuild


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv(nativebuild.CACHE_ENV, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert nativebuild.cache_dir() == tmp_path / "home" / ".cache" / "marin" / "native"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert nativebuild.cache_dir() == tmp_path / "xdg" / "marin" / "native"
    monkeypatch.setenv(nativebuild.CACHE_ENV, str(tmp_path / "explicit"))
    assert nativebuild.cache_dir() == tmp_path / "explicit"


@pytest.mark.parametrize(("value", "off"), [("", False), ("0", False), ("no", False), ("OFF", False),
                                            ("1", True), ("true", True), ("yes", True)])
def test_disable_switch(monkeypatch, value, off):
    monkeypatch.setenv(nativebuild.DISABLE_ENV, value)
    assert nativebuild.native_disabled() is off


def test_compiler_commands(monkeypatch):
    monkeypatch.setenv("CC", "ccache  cc")
    assert nativebuild.compiler_command("c") == ["ccache", "cc"]
    monkeypatch.setenv("CXX", "/opt/bin/g++-14")
    assert nativebuild.compiler_command("c++") == ["/opt/bin/g++-14"]
    monkeypatch.delenv("CXX")
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        nativebuild.compiler_command("c++")
    with pytest.raises(ValueError, match="unknown language"):
        nativebuild.compiler_command("fortran")


def test_build_cached_is_atomic_and_cached(tmp_path):
    target = tmp_path / "cache" / "lib-abc.so"
    calls = []

    def failing(workdir: Path, output: Path) -> None:
        output.write_bytes(b"half a library")
        raise RuntimeError("compiler crashed")

    with pytest.raises(RuntimeError, match="compiler crashed"):
        nativebuild.build_cached(target, failing)
    assert list((tmp_path / "cache").iterdir()) == []  # nothing half-built left behind

    def good(workdir: Path, output: Path) -> None:
        calls.append(workdir)
        (workdir / "scratch.o").write_bytes(b"obj")
        output.write_bytes(b"library")

    assert nativebuild.build_cached(target, good) == target
    assert nativebuild.build_cached(target, good) == target  # cached: not built again
    assert len(calls) == 1 and target.read_bytes() == b"library"
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["lib-abc.so"]


def test_failing_command_reports_its_error(tmp_path):
    with pytest.raises(RuntimeError, match="command not found"):
        nativebuild.run_build_command([str(tmp_path / "no-such-cc"), "-c", "x.c"])
    with pytest.raises(RuntimeError, match="exited with 1"):
        nativebuild.run_build_command(["false"])
