"""marin.runtime: the host allocator settings for CPU compute, and that they take effect."""

import os
import subprocess
import sys
import textwrap

import pytest

from marin.runtime import HOST_MALLOC_TUNABLES, host_malloc_active, host_malloc_env

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="glibc tunables")


@linux_only
def test_env_merges_with_existing_tunables_and_can_be_disabled():
    env = host_malloc_env({"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0:glibc.malloc.arena_max=8"})
    parts = env["GLIBC_TUNABLES"].split(":")
    assert parts[0] == "glibc.malloc.tcache_count=0"  # unrelated settings are kept
    assert "glibc.malloc.arena_max=8" not in parts  # ours win for the names we set
    assert parts[1:] == list(HOST_MALLOC_TUNABLES)
    assert host_malloc_active(env)
    assert not host_malloc_active({})
    assert host_malloc_env({"MARIN_HOST_MALLOC": "0"}) == {}


FAULTS = textwrap.dedent("""
    import resource, sys
    from marin.runtime import reexec_with_host_malloc
    if sys.argv[1:] == ["reexec"]:
        reexec_with_host_malloc()
    import numpy as np

    def step():  # what XLA:CPU does every step: allocate, touch and free a big buffer
        a = np.ones(16 * 2**20, np.float32)  # 64 MiB, above glibc's largest mmap threshold
        return float(a[-1])

    step()
    r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        step()
    print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0) // 5)
""")


@linux_only
def test_reexec_applies_the_settings_and_stops_the_page_faults(tmp_path):
    script = tmp_path / "faults.py"
    script.write_text(FAULTS)
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "MARIN_HOST_MALLOC")}

    def faults(*args, **extra):
        out = subprocess.run([sys.executable, str(script), *args], env={**env, **extra}, capture_output=True,
                             text=True, timeout=120, check=True)
        return int(out.stdout.split()[-1])

    default = faults()
    tuned = faults("reexec")
    assert default >= 32, default  # each 64 MiB buffer is a fresh mapping: at least 32 huge-page faults
    assert tuned * 10 < default, (tuned, default)  # reused heap pages
    assert faults("reexec", MARIN_HOST_MALLOC="0") >= 32  # opt-out keeps glibc's defaults
