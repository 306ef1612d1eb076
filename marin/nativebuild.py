"""Building native code on first use: the one place for compilers, the cache, the switch and the warning.

Two parts of marin compile code the first time a process needs it: the training loader's C kernel
(:mod:`marin.data.native`) and the MoE's CPU grouped-GEMM kernels (:mod:`marin.kernels.cpu`). Both
follow the same rules, defined here:

* **Compiler**: ``$CC`` (else ``cc``) for C, ``$CXX`` (else ``c++``, else ``g++``) for C++; the value
  is split like a shell would, so ``CC="ccache cc"`` works.
* **Cache**: ``$MARIN_NATIVE_CACHE``, else ``$XDG_CACHE_HOME/marin/native``, else
  ``~/.cache/marin/native``. A library's file name carries a key over everything its binary depends on
  (source, compiler command, flags, platform), so a changed kernel or compiler builds a new file and a
  stale one is never loaded. When the cache cannot be written (a read-only home), a private
  per-process directory is used instead.
* **Atomic builds**: every build happens in a private temporary directory inside the cache and the
  result is moved into place with ``os.replace``, so concurrent builders (Ray workers starting at
  once) either find a complete library or build their own identical one; nothing half-built is left.
* **Switch**: ``MARIN_DISABLE_NATIVE=1`` (anything but empty, 0, false, no, off) turns every native
  kernel off; callers then run their numpy / XLA path, which computes the same results, slower.
* **Failure**: a kernel that cannot be built or loaded logs one warning per process saying what is
  used instead and how to silence it (:func:`warn_unavailable`); nothing fails because of it.
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

DISABLE_ENV = "MARIN_DISABLE_NATIVE"
CACHE_ENV = "MARIN_NATIVE_CACHE"


def native_disabled() -> bool:
    """True when ``MARIN_DISABLE_NATIVE`` is set to anything but empty, 0, false, no or off."""
    return os.environ.get(DISABLE_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def compiler_command(language: str = "c") -> list[str]:
    """The compiler command for ``language`` ("c" or "c++"), from the environment or the PATH.

    For C the default is ``cc`` even when it is not on the PATH (the build then fails with the
    shell's message, which names the command); for C++ a missing compiler is an error up front.
    """
    if language == "c":
        return shlex.split(os.environ.get("CC", "").strip() or "cc")
    if language == "c++":
        cxx = os.environ.get("CXX", "").strip() or shutil.which("c++") or shutil.which("g++")
        if not cxx:
            raise RuntimeError("no C++ compiler (c++/g++) on PATH; install one or set CXX")
        return shlex.split(cxx)
    raise ValueError(f"unknown language {language!r}; expected 'c' or 'c++'")


def cache_dir() -> Path:
    """Where built libraries live (see the module docstring)."""
    explicit = os.environ.get(CACHE_ENV, "").strip()
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "marin" / "native"


def writable_cache_dir() -> Path:
    """:func:`cache_dir`, created; a private per-process directory when it cannot be written."""
    directory = cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if not os.access(directory, os.W_OK):
            raise OSError(f"{directory} is not writable")
        return directory
    except OSError:
        return Path(tempfile.mkdtemp(prefix="marin-native-"))


def run_build_command(cmd: list[str]) -> None:
    """Run one compiler or linker command; raise with the tail of its error output on failure."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    except FileNotFoundError as e:
        raise RuntimeError(f"{shlex.join(cmd[:1])}: command not found ({e})") from e
    if proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd[:1])} exited with {proc.returncode}: {proc.stderr.strip()[-2000:]}")


def build_cached(target: Path, build: Callable[[Path, Path], None]) -> Path:
    """Return ``target``, building it first when it does not exist.

    ``build(workdir, output)`` writes the library to ``output`` using the private ``workdir`` for
    anything else (sources, object files); the result is then renamed to ``target`` atomically.
    """
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))
    try:
        output = workdir / target.name
        build(workdir, output)
        os.replace(output, target)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return target


def warn_unavailable(what: str, fallback: str, error: BaseException) -> None:
    """The one warning a process logs when a native kernel cannot be used."""
    logger.warning("marin %s unavailable, using %s (same results, slower): %s. Set %s=1 to skip the build.",
                   what, fallback, error, DISABLE_ENV)
