"""Streaming export from a sharded checkpoint: the same tensors as the in-memory export (float32)
and their bfloat16 rounding, host memory that does not grow with the model, a damaged newest
checkpoint, an unwritable destination, file modes, and resuming a killed export."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time

import fsspec
import jax
import numpy as np
import pytest
import safetensors

from marin.cli import main
from marin.inference.export import PROGRESS_FILE, ExportError, export_checkpoint, export_model
from marin.models.config import get_preset
from marin.models.exported import INDEX_FILE, exported_shapes, read_shard
from marin.models.transformer import init_params, init_router_bias
from marin.pools import get_pool
from marin.training import checkpoint as ckpt
from marin.training.checkpoint import load_model, write_checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cfg(n_layers: int = 3, **kw):
    # local + global layers, padded expert storage (stored width 40 > 36), untied head
    return get_preset("tiny", vocab_size=61, n_layers=n_layers, global_every=2, sliding_window=3, expert_width=36,
                      expert_width_multiple=8, **kw)


def write_run(run_dir: str, cfg, steps=(10,), seed: int = 0) -> None:
    """A run directory with committed checkpoints of ``cfg`` (params, router bias and an optimizer-like
    extra leaf, as training writes them)."""
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))  # shapes only: no compile
    for n, step in enumerate(steps):
        rng = np.random.default_rng(seed + n)
        params = jax.tree.map(lambda s, rng=rng: (rng.standard_normal(s.shape) * 0.1).astype(s.dtype), shapes)
        bias = (rng.standard_normal(init_router_bias(cfg).shape) * 0.2).astype(np.float32)
        pool = dataclasses.asdict(get_pool("local-cpu-1"))  # a run's record holds its pool's spec whole
        meta = {"config": {"model": dataclasses.asdict(cfg), "pool": pool, "data": {"seed": 1}}, "tokens": 1000 * step}
        state = {"params": params, "router_bias": bias, "opt_state": {"count": np.int32(step)}}
        write_checkpoint(f"{run_dir}/checkpoints/{ckpt.step_dirname(step)}", state, meta, step=step)


def tensors_of(out: str) -> dict[str, np.ndarray]:
    index = json.load(open(os.path.join(out, INDEX_FILE)))
    got = {}
    for shard in sorted(set(index["weight_map"].values())):
        got.update(read_shard(os.path.join(out, shard)))
    return got


def bf16_round_reference(a: np.ndarray) -> np.ndarray:
    """float32 -> nearest bfloat16 (ties to even), the slow obvious way on the bits, widened back."""
    u = a.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return (rounded.astype(np.uint32) << 16).view(np.float32)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("run") / "train-tiny-0123abcd")
    write_run(d, _cfg(), steps=(10, 20))
    return d


def test_stream_export_equals_in_memory_export_and_its_bf16_rounding(run, tmp_path):
    model = load_model(run, None)  # today's export: the whole model in this process
    export_model(model.params, model.router_bias, model.config, str(tmp_path / "mem"), max_shard_bytes=20_000)
    want = tensors_of(str(tmp_path / "mem"))
    res = export_checkpoint(run, str(tmp_path / "f32"), dtype="float32", max_shard_bytes=20_000)
    assert res["step"] == 20 and res["shards"] > 2
    got = tensors_of(str(tmp_path / "f32"))
    assert set(got) == set(want) == set(exported_shapes(model.config))
    for name, w in want.items():
        assert got[name].dtype == np.float32 and np.array_equal(got[name], w), name  # bit for bit
    export_checkpoint(run, str(tmp_path / "bf16"), max_shard_bytes=20_000)  # bfloat16 by default
    half = tensors_of(str(tmp_path / "bf16"))
    for name, w in want.items():
        assert np.array_equal(half[name], bf16_round_reference(w)), name
    config = json.load(open(tmp_path / "bf16" / "config.json"))
    assert config["torch_dtype"] == "bfloat16" and config["lineage"]["checkpoint_step"] == 20
    assert not (tmp_path / "bf16" / PROGRESS_FILE).exists()


def test_export_files_are_ordinary_files_and_the_card_names_an_absolute_run(run, tmp_path, monkeypatch):
    monkeypatch.chdir(os.path.dirname(run))
    out = tmp_path / "e"
    export_checkpoint(os.path.basename(run), str(out), max_shard_bytes=20_000)  # a relative run directory
    mask = os.umask(0)
    os.umask(mask)
    modes = {f: stat.S_IMODE(os.stat(out / f).st_mode) for f in os.listdir(out)}
    assert set(modes.values()) == {0o666 & ~mask}, modes
    card = (out / "README.md").read_text()
    assert f"({run})" in card and "bfloat16 tensors" in card
    assert json.load(open(out / "config.json"))["lineage"]["run_dir"] == run


@pytest.mark.parametrize("damage", ["flipped byte", "missing part record"])
def test_a_damaged_newest_checkpoint_falls_back_in_one_line(run, tmp_path, capsys, caplog, damage):
    import shutil

    damaged_run = str(tmp_path / "train-tiny-0123abcd")
    shutil.copytree(run, damaged_run)
    newest = f"{damaged_run}/checkpoints/{ckpt.step_dirname(20)}"
    if damage == "flipped byte":
        key = "['params']['blocks']['expert_up']"
        leaf = next(e for e in ckpt.read_index(newest)["leaves"] if e["key"] == key)
        chunks = [os.path.join(r, f) for r, _, fs in os.walk(f"{newest}/{leaf['array']}") for f in fs
                  if f != "zarr.json"]
        with open(chunks[0], "r+b") as f:
            f.seek(100)
            b = f.read(1)
            f.seek(100)
            f.write(bytes([b[0] ^ 0x10]))
    else:
        os.remove(f"{newest}/parts/process-00000.json")
    out = str(tmp_path / "out")
    with caplog.at_level("WARNING", logger="marin.inference.run"):
        rc = main(["export", damaged_run, "-o", out, "--max-shard-size", "20000"])
    text, err = capsys.readouterr()
    assert rc == 0, err
    (line,) = caplog.messages
    assert f"checkpoint {newest} is damaged" in line
    assert line.endswith("using step 10, the newest checkpoint that verifies")
    assert "exported step 10" in text
    assert json.load(open(os.path.join(out, "config.json")))["lineage"]["checkpoint_step"] == 10
    # asked for by number, the damaged one is refused in one line naming the option
    rc = main(["export", damaged_run, "-o", str(tmp_path / "out2"), "--step", "20"])
    _, err = capsys.readouterr()
    assert rc == 2 and err.count("\n") == 1 and f"checkpoint {newest} is damaged" in err and "--step 10" in err, err


def test_an_unwritable_destination_is_one_line_before_any_read(run, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    places = [blocker / "x"]  # a place no one can create, root included
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    if not os.access(ro, os.W_OK):  # a read-only directory (not for root, who writes anywhere)
        places.append(ro / "x")
    try:
        for place in places:
            rc = main(["export", run, "-o", str(place)])
            _, err = capsys.readouterr()
            assert rc == 2 and err.count("\n") == 1 and "cannot write the export to" in err, err
            assert not place.exists()
    finally:
        ro.chmod(0o755)


def test_dry_run_says_shards_bytes_and_host_memory(run, tmp_path, capsys):
    out = tmp_path / "never"
    rc = main(["export", run, "-o", str(out), "--dry-run", "--max-shard-size", "20000", "--processes", "2"])
    text, err = capsys.readouterr()
    assert rc == 0, err
    assert "would export step 20" in text and "shard(s)" in text and "host memory over 2 process(es)" in text
    assert not out.exists()


def test_export_refuses_an_unfinished_export_with_other_options(run, tmp_path):
    out = tmp_path / "e"
    out.mkdir()
    (out / PROGRESS_FILE).write_text(json.dumps({"step": 20, "dtype": "float32", "max_shard_bytes": 5, "done": {}}))
    with pytest.raises(ExportError, match="holds an unfinished export of step 20 .*rerun with those options"):
        export_checkpoint(run, str(out))


RSS_CHILD = """
import json, sys
from marin.inference.export import export_checkpoint
export_checkpoint(sys.argv[1], sys.argv[2], max_shard_bytes=int(sys.argv[3]))
assert not any(m == "jax" or m.startswith("jax.") for m in sys.modules), "the export imported JAX"
# VmHWM, this process's own peak: getrusage's ru_maxrss keeps the parent's peak across exec
hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"peak_rss": int(hwm.split()[1]) * 1024}))
"""


def _wide(n_layers: int):
    # layers large enough that the model, not the interpreter, would dominate an export's memory
    return get_preset("tiny", vocab_size=256, n_layers=n_layers, d_model=128, n_experts=16, latent_dim=128,
                      expert_width=512, expert_width_multiple=8)


@pytest.mark.slow  # about 30 s here: two 100 MB checkpoints written and exported in subprocesses
def test_peak_memory_does_not_grow_with_the_number_of_layers(tmp_path, monkeypatch):
    # chunks of 4 MiB: like the hero's, whose shards are far larger than one layer's slice of them
    monkeypatch.setattr(ckpt.format, "CHUNK_BYTES", 4 << 20)
    peaks, model_bytes = {}, {}
    for layers in (2, 8):
        cfg = _wide(layers)
        run_dir = str(tmp_path / f"train-wide{layers}-00000000")
        write_run(run_dir, cfg)
        model_bytes[layers] = sum(int(np.prod(s)) * 4 for s in exported_shapes(cfg).values())
        proc = subprocess.run([sys.executable, "-c", RSS_CHILD, run_dir, str(tmp_path / f"out{layers}"),
                               str(4 << 20)], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        peaks[layers] = json.loads(proc.stdout.strip().splitlines()[-1])["peak_rss"]
    # the test can tell: holding the model would add more than 30% to the small export's peak
    assert model_bytes[8] - model_bytes[2] > 0.3 * peaks[2], (model_bytes, peaks)
    assert peaks[8] < 1.3 * peaks[2], peaks


def _files(url: str) -> dict[str, bytes]:
    fs, root = fsspec.core.url_to_fs(url)
    fs.invalidate_cache()
    return {p.rstrip("/").rsplit("/", 1)[-1]: fs.cat_file(p) for p in fs.ls(root, detail=False)}


def _check_no_half_shards(url: str) -> None:
    """Every shard under its final name is complete: it parses and holds what its name promises."""
    for name, data in _files(url).items():
        if name.endswith(".safetensors"):
            assert safetensors.deserialize(data), name


def test_an_export_that_stopped_half_way_continues_to_the_same_files(run, tmp_path, monkeypatch):
    import marin.inference.export as export

    export_checkpoint(run, str(tmp_path / "whole"), max_shard_bytes=20_000)
    real, calls = export.write_safetensors, []

    def crash_on_the_fourth_shard(*a, **kw):
        calls.append(a[1])
        if len(calls) == 4:
            raise OSError("disk went away")  # a writer dying between shards, as a kill would
        return real(*a, **kw)

    monkeypatch.setattr(export, "write_safetensors", crash_on_the_fourth_shard)
    out = str(tmp_path / "resumed")
    with pytest.raises(OSError, match="disk went away"):
        export_checkpoint(run, out, max_shard_bytes=20_000)
    assert not os.path.exists(os.path.join(out, INDEX_FILE))  # not complete, and does not look it
    assert len(json.load(open(os.path.join(out, PROGRESS_FILE)))["done"]) == 3
    monkeypatch.setattr(export, "write_safetensors", real)
    written = []
    monkeypatch.setattr(export, "write_safetensors", lambda *a, **kw: written.append(a[1]) or real(*a, **kw))
    res = export_checkpoint(run, out, max_shard_bytes=20_000)
    assert res["resumed"] and set(written).isdisjoint(calls[:3])  # the finished shards were not redone
    assert _files(out) == _files(str(tmp_path / "whole"))


KILL_CHILD = """
import sys
from marin.cli import main
sys.exit(main(["export", sys.argv[1], "-o", sys.argv[2], "--max-shard-size", str(1 << 20), "--processes", "2"]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("store", ["local", "s3", "gcs"])
def test_kill_9_mid_export_then_rerun_equals_an_uninterrupted_export(tmp_path, request, store):
    cfg = _wide(2)  # about 26 shards of 1 MiB
    run_dir = str(tmp_path / "train-wide2-00000000")
    write_run(run_dir, cfg)
    base = {"local": str(tmp_path), "s3": "s3_bucket", "gcs": "gcs_bucket"}[store]
    base = base if store == "local" else request.getfixturevalue(base)
    whole, out = f"{base}/whole", f"{base}/killed"
    assert subprocess.run([sys.executable, "-c", KILL_CHILD, run_dir, whole], timeout=600).returncode == 0
    fs, root = fsspec.core.url_to_fs(out)
    proc = subprocess.Popen([sys.executable, "-c", KILL_CHILD, run_dir, out], start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        try:
            if json.loads(fs.cat_file(f"{root}/{PROGRESS_FILE}"))["done"]:
                break
        except (FileNotFoundError, ValueError):
            pass
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)  # the command and its worker processes, mid-export
    proc.wait()
    left = _files(out)
    assert INDEX_FILE not in left and PROGRESS_FILE in left, sorted(left)  # killed before the end
    _check_no_half_shards(out)
    assert subprocess.run([sys.executable, "-c", KILL_CHILD, run_dir, out], timeout=600).returncode == 0
    assert _files(out) == _files(whole)


def test_chunk_shape_cuts_the_leading_axis_of_a_large_shard_to_a_divisor():
    def reference(shape, itemsize, target):  # the slow obvious way: try every row count, keep the best
        if not shape or int(np.prod(shape)) * itemsize <= target:
            return tuple(shape)
        row = int(np.prod(shape[1:])) * itemsize
        fits = [r for r in range(1, shape[0] + 1) if shape[0] % r == 0 and r * row <= target] or [1]
        return (max(fits), *shape[1:])

    for shape in [(), (7,), (16, 1000, 1000), (48, 384, 7168), (6, 5, 5), (1, 10_000), (100_000, 64)]:
        for target in (1, 1000, 64 << 20):
            assert ckpt.chunk_shape(shape, 4, target) == reference(shape, 4, target), (shape, target)


def test_a_multi_host_pool_is_refused_in_one_line_by_the_harness(run, capsys):
    rc = main(["harness", run, "--tasks", "x", "--pool", "local-2host"])
    _, err = capsys.readouterr()
    assert rc == 2 and err.count("\n") == 1 and "local-2host has 2 hosts" in err and "single-host pool" in err, err
    assert "lm-evaluation-harness drives the model from one Python process" in err


def test_a_store_without_credentials_is_one_line(run, tmp_path, capsys, monkeypatch):
    import s3fs

    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    s3fs.S3FileSystem.clear_instance_cache()
    for extra in ([], ["--dry-run"]):
        rc = main(["export", run, "-o", "s3://no-such-bucket/out", *extra])
        _, err = capsys.readouterr()
        assert rc == 2 and err.count("\n") == 1 and "s3://no-such-bucket/out" in err and "credentials" in err, err
    s3fs.S3FileSystem.clear_instance_cache()


def test_chunks_smaller_than_shards_restore_onto_another_mesh(tmp_path, monkeypatch):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from marin.parallel.mesh import make_mesh

    monkeypatch.setattr(ckpt.format, "CHUNK_BYTES", 200)  # every shard below is split along its leading axis
    rng = np.random.default_rng(3)
    whole = rng.standard_normal((12, 8, 16)).astype(np.float32)  # [layers, rows, cols]
    write_mesh = make_mesh(2, 4)
    x = jax.device_put(whole, NamedSharding(write_mesh, P(None, "data", "expert")))
    path = str(tmp_path / "c")
    write_checkpoint(path, {"w": x}, {}, step=1)
    entry = ckpt.read_index(path)["leaves"][0]
    assert entry["chunk"] == [3, 4, 4]  # the [12, 4, 4] shard (768 B) in chunks of 3 layers (192 B)
    read_mesh = make_mesh(1, 8)
    got, _ = ckpt.restore_checkpoint(path, {"w": x}, {"w": NamedSharding(read_mesh, P(None, None, "expert"))})
    assert np.array_equal(np.asarray(got["w"]), whole)
    readers, _ = ckpt.open_leaves(path)
    assert np.array_equal(np.asarray(readers["['w']"][5][..., :3]), whole[5][..., :3])


def test_a_destination_url_with_credentials_is_refused_without_echoing_them(run, capsys):
    for extra in ([], ["--dry-run"]):
        rc = main(["export", run, "-o", "s3://AKIAFAKE:secretvalue@bucket/x", *extra])
        _, err = capsys.readouterr()
        assert rc == 2 and err.count("\n") == 1, err
        assert err.startswith("marin: error: -o s3://***@bucket/x has credentials in it (the part before '@'); an "
                              "object store takes credentials from the environment"), err
        assert "secretvalue" not in err and "AKIAFAKE" not in err


FULL_DISK = """
mount -t tmpfs -o size=64k tmpfs "$DEST" || exit 90
run_export() { "$PY" -m marin.cli export "$RUN" -o "$DEST/x" --dtype float32 --max-shard-size 20000; }
run_export > "$LOG/out1" 2> "$LOG/err1"; echo $? > "$LOG/rc1"
ls -A "$DEST/x" > "$LOG/ls1"
mount -o remount,size=4m "$DEST" || exit 91
run_export > "$LOG/out2" 2> "$LOG/err2"; echo $? > "$LOG/rc2"
cp -r "$DEST/x" "$LOG/x"
"""


def test_an_export_to_a_full_disk_is_one_line_leaves_no_partial_file_and_continues(run, tmp_path):
    """A real 64 KiB filesystem (a tmpfs in a private mount namespace, as tests/execution/test_disk_full.py
    mounts them) fills during the export; with room made, the same command finishes it."""
    dest, log = tmp_path / "dest", tmp_path / "log"
    dest.mkdir()
    log.mkdir()
    env = {**os.environ, "PYTHONPATH": REPO, "RUN": run, "DEST": str(dest), "LOG": str(log), "PY": sys.executable}
    r = subprocess.run(["unshare", "-rm", "sh", "-c", FULL_DISK], env=env, capture_output=True, text=True,
                       timeout=300) if shutil.which("unshare") else None
    if r is None or r.returncode in (90, 91) or r.stderr.startswith("unshare:"):
        pytest.skip("mounting a small filesystem needs root or unprivileged user namespaces")
    assert r.returncode == 0, r.stderr
    err = (log / "err1").read_text()
    assert (log / "rc1").read_text().strip() == "2" and err.count("\n") == 1, err
    assert err == (f"marin: error: cannot write the export to {dest}/x: the disk filled up (64.0 KiB in all); free "
                   "space, then rerun the same command: it continues from the shards already written (no file is "
                   "left half-written)\n")
    left = (log / "ls1").read_text().split()
    assert PROGRESS_FILE in left and INDEX_FILE not in left and not [f for f in left if f.endswith(".partial")], left
    assert (log / "rc2").read_text().strip() == "0", (log / "err2").read_text()
    assert "(continued an interrupted export)" in (log / "out2").read_text()
    export_checkpoint(run, str(tmp_path / "ref"), dtype="float32", max_shard_bytes=20_000)
    want, got = tensors_of(str(tmp_path / "ref")), tensors_of(str(log / "x"))
    assert set(got) == set(want) and all(np.array_equal(got[k], want[k]) for k in want)
