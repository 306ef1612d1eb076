"""Process-level allocator settings for CPU steps with large arrays (XLA:CPU keeps them in host memory).

glibc's malloc serves allocations of 32 MiB and more with fresh mmap()s and hands freed memory back
to the OS. XLA:CPU allocates and frees its large buffers on every execution, so each one then pays a
page fault on every fresh page: about 115,000 minor faults (450 MiB of zeroed pages) per
forward+backward of the d=1024 MoE benchmark block. Never mmapping, never trimming and using few
arenas makes repeated executions reuse the same pages (close to 0 faults after warm-up), the way a
caching allocator would: in benchmarks/moe_bench.py both the MoE block and the dense baseline get
10-14% faster.

It is not a default for training hosts: with small arrays there are no faults to save, and fewer
arenas make the many small allocations of 8 fake devices contend (train_bench tiny-ep ran 10-20%
slower with them). glibc reads tunables only when a process starts, so they are applied by
re-executing a script (reexec_with_host_malloc). MARIN_HOST_MALLOC=0 turns this off.
"""

from __future__ import annotations

import os
import platform
import sys

HOST_MALLOC_TUNABLES = (
    "glibc.malloc.mmap_max=0",  # never mmap: big blocks come from (and go back to) the heap
    "glibc.malloc.trim_threshold=4294967296",  # never give the heap's top back to the OS
    "glibc.malloc.arena_max=2",  # few arenas, so blocks freed by one thread are reused by the others
)


def host_malloc_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment entries that apply HOST_MALLOC_TUNABLES (merged with any GLIBC_TUNABLES already
    set), or {} when disabled (MARIN_HOST_MALLOC=0) or not on Linux."""
    environ = os.environ if environ is None else environ
    if environ.get("MARIN_HOST_MALLOC", "1") == "0" or platform.system() != "Linux":
        return {}
    current = [t for t in environ.get("GLIBC_TUNABLES", "").split(":") if t]
    names = {t.split("=", 1)[0] for t in HOST_MALLOC_TUNABLES}
    merged = [t for t in current if t.split("=", 1)[0] not in names] + list(HOST_MALLOC_TUNABLES)
    return {"GLIBC_TUNABLES": ":".join(merged)}


def host_malloc_active(environ: dict[str, str] | None = None) -> bool:
    """Whether this process was started with the tunables in place."""
    environ = os.environ if environ is None else environ
    have = set(environ.get("GLIBC_TUNABLES", "").split(":"))
    return all(t in have for t in HOST_MALLOC_TUNABLES)


def reexec_with_host_malloc() -> None:
    """Restart this Python script with the tunables in its environment, unless they are already there
    or disabled. Call it first thing in a script's main, before anything heavy is imported."""
    env = host_malloc_env()
    if not env or host_malloc_active() or os.environ.get("_MARIN_REEXECED"):  # the marker: exec once at most
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **env, "_MARIN_REEXECED": "1"})
