"""The native loader kernel (marin/data/native.py): identical to the numpy path, and a clean fallback.

Tests that need the kernel itself skip when this machine has no C compiler; the fallback tests run
everywhere.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from marin import nativebuild
from marin.data import native
from marin.data.loader import MixtureLoader
from marin.data.mixture import MixtureConfig
from marin.data.order import WITH_REPLACEMENT
from marin.data.segments import segment_ids_from_eos

HAVE_CC = shutil.which((native.compiler_command() or ["cc"])[0]) is not None
needs_cc = pytest.mark.skipif(not HAVE_CC, reason="no C compiler to build the native kernel")


@pytest.fixture
def fresh_native(monkeypatch, tmp_path):
    """A private kernel cache and no remembered kernel, before and after the test."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(native.DISABLE_ENV, raising=False)
    monkeypatch.delenv(nativebuild.CACHE_ENV, raising=False)
    native.reset()
    yield tmp_path / "xdg" / "marin" / "native"
    native.reset()


@pytest.fixture(scope="module")
def kernel():
    if native.native_disabled():
        pytest.skip(f"{native.DISABLE_ENV} is set")
    k = native.kernel()
    if k is None:
        pytest.skip("native kernel unavailable (see the warning)")
    return k


def _isas(kernel):
    """Every implementation this CPU can run (scalar, SSE2, AVX2 where present), restoring the best."""
    try:
        seen = []
        for level in (1, 2, 0):
            isa = kernel.use_isa(level)
            if isa not in seen:
                seen.append(isa)
                yield isa
    finally:
        kernel.use_isa(0)


def _reference(tokens: np.ndarray, eos: int) -> np.ndarray:
    """The definition, as a loop: EOS tokens strictly before each position in its row."""
    out = np.zeros(tokens.shape, np.int32)
    for r in range(tokens.shape[0]):
        c = 0
        for j in range(tokens.shape[1]):
            out[r, j] = c
            c += int(tokens[r, j] == eos)
    return out


# --------------------------------------------------------------------------------------------------
# the kernel on its own


@needs_cc
def test_kernel_rows_and_pieces_match_numpy(kernel):
    rng = np.random.default_rng(0)
    shapes = [(0, 5), (3, 0), (1, 1), (5, 1), (2, 2), (3, 7), (4, 8), (4, 15), (3, 16), (5, 17), (2, 31), (7, 33),
              (3, 100), (2, 1000), (4, 4097)]
    for isa in _isas(kernel):
        for rows, n in shapes:
            for eos, density in [(0, 0.3), (7, 0.01), (2**31 - 1, 0.1), (5, 0.0), (3, 1.0)]:
                pool = rng.integers(0, 2**31 - 1, rows * n + 64).astype(np.uint32)
                pool[rng.random(pool.size) < density] = eos
                want = np.empty((rows, n), np.uint32)
                row_ptr = np.zeros(rows, np.uint64)
                extra: list[tuple[int, int]] = []
                for r in range(rows):
                    a = int(rng.integers(0, pool.size - n + 1))
                    want[r] = pool[a:a + n]
                    if rng.random() < 0.5 and n > 0:
                        row_ptr[r] = pool[a:].ctypes.data
                        continue
                    # several pieces, some empty, at random cuts (as wraps and shard crossings give)
                    cuts = np.sort(rng.integers(0, n + 1, int(rng.integers(0, 4))))
                    bounds = [0, *cuts.tolist(), n]
                    for lo, hi in itertools.pairwise(bounds):
                        extra.append((pool[a + lo:].ctypes.data if hi > lo else 0, hi - lo))
                out = np.full((rows, n), 12345, np.uint32)
                seg = np.full((rows, n), -1, np.int32)
                kernel.fill_rows(row_ptr, np.array(extra, np.uint64).reshape(-1, 2), out, seg, eos)
                ref = segment_ids_from_eos(want.view(np.int32), eos) if n else seg
                np.testing.assert_array_equal(out, want, err_msg=f"{isa} {rows}x{n} eos={eos}")
                np.testing.assert_array_equal(seg, ref, err_msg=f"{isa} {rows}x{n} eos={eos}")
                np.testing.assert_array_equal(kernel.segment_ids(want, eos), ref, err_msg=f"{isa} {rows}x{n}")
                if rows and n and n < 40:
                    np.testing.assert_array_equal(seg, _reference(want, eos))


@needs_cc
def test_kernel_segment_ids_edges(kernel):
    edge = np.array([[0, 1, 2, 0], [3, 0, 0, 0], [5, 5, 5, 5], [0, 0, 0, 0]], dtype=np.int32)
    for _ in _isas(kernel):
        np.testing.assert_array_equal(
            kernel.segment_ids(edge, 0), [[0, 1, 1, 1], [0, 0, 1, 2], [0, 0, 0, 0], [0, 1, 2, 3]]
        )
        long_eos = np.zeros((2, 1000), np.int32)  # every token an EOS: ids 0..999 per row
        np.testing.assert_array_equal(kernel.segment_ids(long_eos, 0), np.tile(np.arange(1000, dtype=np.int32), (2, 1)))


@needs_cc
def test_kernel_rejects_pieces_that_do_not_add_up(kernel):
    pool = np.arange(100, dtype=np.uint32)
    out, seg = np.empty((2, 10), np.uint32), np.empty((2, 10), np.int32)
    rp = np.array([pool.ctypes.data, 0], np.uint64)
    for extra in (
        [],
        [(pool.ctypes.data, 4)],
        [(pool.ctypes.data, 11)],
        [(pool.ctypes.data, 10), (pool.ctypes.data, 1)],
        [(0, 10)],
    ):
        with pytest.raises(RuntimeError, match="do not add up"):
            kernel.fill_rows(rp, np.array(extra, np.uint64).reshape(-1, 2), out, seg, 0)
    kernel.fill_rows(rp, np.array([(pool.ctypes.data + 40, 10), (0, 0)], np.uint64), out, seg, 10)
    np.testing.assert_array_equal(out, [np.arange(10), np.arange(10, 20)])
    np.testing.assert_array_equal(seg, [[0] * 10, [0] + [1] * 9])  # eos 10 opens row 1: the rest is document 1


# --------------------------------------------------------------------------------------------------
# the loader: native and numpy give the same batches


@pytest.fixture(scope="module")
def loaders(mini_store):
    """Two loaders on the small store (2,000-token shards: many shard crossings; small sources wrap)."""
    cfg = MixtureConfig(stores=(mini_store,), domain_weights={"council": 4, "infra": 2, "web_code": 1, "science": 1},
                        seed=11, order=WITH_REPLACEMENT)  # rows drawn independently: any (step, rows, seq_len)
    return MixtureLoader(cfg), MixtureLoader(MixtureConfig(stores=(mini_store,), seed=5, order=WITH_REPLACEMENT))


@needs_cc
def test_batches_native_equal_numpy(loaders, kernel, monkeypatch):
    rng = np.random.default_rng(1)
    cases = [(0, 1, 1), (1, 3, 1), (2, 64, 2), (3, 1, 20000), (4, 2, 50000), (5, 16, 1999), (6, 8, 2000),
             (7, 4, 4095), (8, 33, 7)]
    cases += [(int(rng.integers(0, 10**9)), int(rng.integers(1, 40)), int(rng.integers(1, 6000))) for _ in range(30)]
    crossings = 0
    for loader in loaders:
        for step, bs, sl in cases:
            monkeypatch.delenv(native.DISABLE_ENV, raising=False)
            got = loader.batch(step, bs, sl)
            monkeypatch.setenv(native.DISABLE_ENV, "1")
            want = loader.batch(step, bs, sl)
            for key in ("tokens", "segment_ids"):
                assert got[key].dtype == np.int32 and got[key].shape == (bs, sl + 1)
                np.testing.assert_array_equal(got[key], want[key], err_msg=f"{key} step={step} {bs}x{sl}")
            np.testing.assert_array_equal(got["segment_ids"], segment_ids_from_eos(got["tokens"], loader.eos_id))
            crossings += int((~loader._locate(*loader.plan(step, bs), sl + 1)[2]).sum())
    assert crossings > 50  # the cases did exercise wrapping and shard-crossing rows


@needs_cc
def test_batch_uses_the_kernel_unless_disabled(loaders, kernel, monkeypatch):
    loader = loaders[0]
    calls = []
    real = native.NativeKernel.fill_rows_at
    monkeypatch.setattr(native.NativeKernel, "fill_rows_at", lambda self, *a: calls.append(1) or real(self, *a))
    monkeypatch.delenv(native.DISABLE_ENV, raising=False)
    a = loader.batch(3, 8, 300)
    assert calls == [1]
    for value in ("1", "true", "yes"):
        monkeypatch.setenv(native.DISABLE_ENV, value)
        assert native.kernel() is None
        b = loader.batch(3, 8, 300)
        assert calls == [1]
        np.testing.assert_array_equal(a["tokens"], b["tokens"])
        np.testing.assert_array_equal(a["segment_ids"], b["segment_ids"])
    monkeypatch.setenv(native.DISABLE_ENV, "0")
    assert native.kernel() is not None


@needs_cc
def test_remote_path_segment_ids(loaders, kernel, monkeypatch):
    """Stores with remote sources take the general fill; the kernel then only writes segment ids."""
    loader = MixtureLoader(loaders[0].config)
    loader._all_local = False
    for step, bs, sl in [(0, 4, 100), (1, 2, 20000), (2, 8, 1)]:
        got = loader.batch(step, bs, sl)
        ref = loaders[0].batch(step, bs, sl)
        np.testing.assert_array_equal(got["tokens"], ref["tokens"])
        np.testing.assert_array_equal(got["segment_ids"], ref["segment_ids"])


# --------------------------------------------------------------------------------------------------
# build, cache and fallback


def test_disable_env_forces_fallback(fresh_native, monkeypatch, loaders, caplog):
    monkeypatch.setenv(native.DISABLE_ENV, "1")
    monkeypatch.setattr(native, "build_and_load", lambda *a: pytest.fail("must not build when disabled"))
    with caplog.at_level(logging.WARNING, logger="marin.nativebuild"):
        assert native.kernel() is None
        b = loaders[0].batch(0, 4, 64)
    assert not caplog.records
    np.testing.assert_array_equal(b["segment_ids"], segment_ids_from_eos(b["tokens"], loaders[0].eos_id))


@pytest.mark.parametrize("cc", ["/nonexistent/cc", "false"])
def test_missing_or_failing_compiler_falls_back_with_one_warning(fresh_native, monkeypatch, loaders, caplog, cc):
    monkeypatch.setenv("CC", cc)
    loader = loaders[1]
    with caplog.at_level(logging.WARNING, logger="marin.nativebuild"):
        assert native.kernel() is None
        got = [loader.batch(s, 4, 500) for s in range(3)]
        assert native.kernel() is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "numpy path" in warnings[0].getMessage() and native.DISABLE_ENV in warnings[0].getMessage()
    monkeypatch.setenv(native.DISABLE_ENV, "1")
    for s, b in enumerate(got):
        want = loader.batch(s, 4, 500)
        np.testing.assert_array_equal(b["tokens"], want["tokens"])
        np.testing.assert_array_equal(b["segment_ids"], want["segment_ids"])
    assert not fresh_native.exists() or not list(fresh_native.glob("*.so"))


@needs_cc
def test_build_is_cached_by_source_hash(fresh_native, monkeypatch):
    k = native.kernel()
    assert k is not None
    assert k.path.parent == fresh_native and k.path.name == f"loader-{native.build_key(native.compiler_command())}.so"
    assert k.path.with_suffix(".c").read_text() == native.C_SOURCE
    assert {p.name for p in fresh_native.iterdir()} == {k.path.name, k.path.with_suffix(".c").name}  # no temp dirs
    # A second process (here: a reset) loads the cached library without compiling.
    native.reset()
    monkeypatch.setattr(nativebuild.subprocess, "run", lambda *a, **kw: pytest.fail("compiled although cached"))
    assert native.kernel().path == k.path
    # Another source or compiler gets another file.
    assert native.build_key(["cc"]) != native.build_key(["clang"])
    monkeypatch.setattr(native, "C_SOURCE", native.C_SOURCE + "\n/* changed */\n")
    assert native.build_key(native.compiler_command()) not in k.path.name


def _run_python(code: str, xdg: Path, **env_extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "XDG_CACHE_HOME": str(xdg), **env_extra}
    env.pop(native.DISABLE_ENV, None)
    env.pop(nativebuild.CACHE_ENV, None)
    root = str(Path(native.__file__).resolve().parents[2])
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        check=False,
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=180,
    )


@needs_cc
def test_broken_cached_library_is_rebuilt(tmp_path):
    """A cached file that does not load (e.g. truncated by hand) is rebuilt. In fresh processes: a
    process never reloads a library it already loaded under the same path."""
    xdg = tmp_path / "xdg"
    first = _run_python("from marin.data import native; print(native.build_and_load().path)", xdg)
    assert first.returncode == 0, first.stderr
    so = Path(first.stdout.strip())
    tmp = so.with_name("garbage")
    tmp.write_bytes(b"not an ELF file")
    os.replace(tmp, so)
    again = _run_python("from marin.data import native; k = native.kernel(); print(k.path if k else None)", xdg)
    assert again.returncode == 0 and again.stdout.strip() == str(so), again.stderr
    assert "WARNING" not in again.stderr and so.stat().st_size > 1000


@needs_cc
def test_concurrent_builds_in_separate_processes(tmp_path):
    """Several processes building at once into one empty cache all get a working kernel."""
    code = "from marin.data import native; print(native.build_and_load().path)"
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    env.pop(native.DISABLE_ENV, None)
    env.pop(nativebuild.CACHE_ENV, None)
    root = str(Path(native.__file__).resolve().parents[2])
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, cwd=root, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=180) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1] for o in outs]
    assert len({o[0].strip() for o in outs}) == 1
    left = sorted(p.name for p in (tmp_path / "xdg" / "marin" / "native").iterdir())
    assert len(left) == 2 and left[0].endswith(".c") and left[1].endswith(".so"), left
