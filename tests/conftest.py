"""Shared test set-up: environment for JAX fake devices, Ray, W&B and the storage emulators.

The environment is set here, at import time, before any test module imports jax or ray.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable

import pytest

# Eight fake CPU devices, so the tests' meshes (EP x DP up to 8) exist on one machine. The suite
# compiles about a thousand small programs and runs each a few times on tiny models, so XLA's CPU
# compiler is most of its time. No LLVM optimisation of the generated code makes those compiles much
# cheaper and the tiny programs run no slower (docs/performance.md). Every process a test starts
# inherits them (CPU pools' hosts keep them beside their own device count); a flag already in
# XLA_FLAGS is left as it is.
for _flag, _value in (("xla_force_host_platform_device_count", "8"), ("xla_backend_optimization_level", "0")):
    if _flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --{_flag}={_value}".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def ray_local(s3_endpoint, gcs_endpoint):
    """One local Ray cluster for the whole test session (started on first use).

    Started after the storage emulators so its workers inherit their endpoints. It offers a
    custom resource ``test-accelerator`` so resource requests can be checked for real.
    """
    import ray

    from marin.execution.cluster import retry_startup_timeouts

    if not ray.is_initialized():
        # started again, as marin starts its own local cluster, if its node misses Ray's fixed 30 s
        # startup deadline: on a machine loaded by the other worker's Ray clusters and JAX pools it can
        retry_startup_timeouts(lambda: ray.init(address="local", num_cpus=4, resources={"test-accelerator": 2},
                                                include_dashboard=False, log_to_driver=False),
                               "the tests' local Ray cluster")
    yield ray


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_endpoint():
    """A local S3-compatible server (moto) on 127.0.0.1; yields its endpoint URL.

    Sets the AWS and fsspec environment so ``s3://`` paths anywhere in the process (and in Ray
    workers started afterwards) reach it.
    """
    from moto.server import ThreadedMotoServer

    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    url = f"http://127.0.0.1:{port}"
    for k, v in {
        "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": url, "AWS_ENDPOINT_URL_S3": url,
    }.items():
        os.environ[k] = v
    yield url
    server.stop()


@pytest.fixture()
def s3_bucket(s3_endpoint):
    """A fresh bucket; yields ``s3://<bucket>``."""
    import uuid

    import boto3

    name = f"test-{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=name)
    import fsspec

    fsspec.filesystem("s3").invalidate_cache()
    yield f"s3://{name}"


@pytest.fixture(scope="session")
def gcs_endpoint():
    """A local GCS emulator (gcp-storage-emulator) on 127.0.0.1 in a subprocess; yields its URL."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1", "--port", str(port),
         "--in-memory", "--default-bucket", "marin-test"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            time.sleep(0.1)
    os.environ["STORAGE_EMULATOR_HOST"] = url
    os.environ["FSSPEC_GS_TOKEN"] = "anon"
    yield url
    proc.terminate()
    proc.wait(10)


@pytest.fixture()
def gcs_bucket(gcs_endpoint):
    """A fresh prefix in the emulator's default bucket; yields ``gs://marin-test/<unique>``."""
    import uuid

    import fsspec

    fs = fsspec.filesystem("gs", token="anon")
    fs.invalidate_cache()
    yield f"gs://marin-test/{uuid.uuid4().hex[:10]}"


class RestartableS3:
    """A moto server on a port of its own that can be stopped and started again on that port (its
    buckets live in this process, so they survive the restart, as a real store's data does). It holds
    one bucket, ``outage``."""

    def __init__(self, monkeypatch) -> None:
        import boto3
        import fsspec

        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                     "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": self.url,
                     "AWS_ENDPOINT_URL_S3": self.url}.items():
            monkeypatch.setenv(k, v)
        self.server = None
        self.start()
        boto3.client("s3", endpoint_url=self.url).create_bucket(Bucket="outage")
        fsspec.filesystem("s3").clear_instance_cache()
        fsspec.filesystem("s3", skip_instance_cache=True)

    def start(self) -> None:
        from moto.server import ThreadedMotoServer

        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()

    def stop(self) -> None:
        self.server.stop()
        self.server = None


@pytest.fixture()
def restartable_s3(monkeypatch):
    """An S3 server of this test's own (:class:`RestartableS3`) that the test stops and starts to make
    an outage; ``s3://`` reaches it until the test ends, then the session's server again."""
    import fsspec
    import s3fs

    from marin.execution import storage

    fsspec.config.conf.pop("s3", None)
    store = RestartableS3(monkeypatch)
    storage._fs_for.cache_clear()  # s3fs caches one filesystem per set of options: reach this server
    yield store
    if store.server is not None:
        store.stop()
    # forget every filesystem bound to this server: later tests reach the session's S3 server again
    s3fs.S3FileSystem.clear_instance_cache()
    storage._fs_for.cache_clear()


OFFLINE_K40_ROOT = "s3://no-such-bucket-anywhere/k40"


@pytest.fixture()
def offline_k40(monkeypatch):
    """Experiment files read the Harrier K40 root at import: point it at a bucket that does not exist,
    so planning them needs no network and any read of the data fails at once. The experiment modules
    an earlier test of this process imported (with the default root) are set aside for the test, so
    they are imported again under this root, and put back after it."""
    monkeypatch.setenv("HARRIER_K40_ROOT", OFFLINE_K40_ROOT)
    for name in [m for m in sys.modules if m == "experiments" or m.startswith("experiments.")]:
        monkeypatch.delitem(sys.modules, name)
    return OFFLINE_K40_ROOT


def build_once(factory, name: str, build: Callable[[str], None]) -> str:
    """The directory ``name``, built by ``build(path)`` once per test run and shared by its workers.

    A session fixture is built in each pytest-xdist worker that uses it; an expensive one (a trained
    run, a token store) is built here instead, under a lock in the directory that all workers of this
    run share: the first worker to ask builds it, the others wait and read the same files. A build that
    failed part-way is removed and tried again by the next caller. What is built is read-only by
    convention: a test that changes it copies it first.
    """
    base = factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "built-once"
    root.mkdir(exist_ok=True)
    out, done = root / name, root / f"{name}.done"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not done.exists():
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            build(str(out))
            done.touch()
    return str(out)


class K40Data:
    """Builders of a small K40-shaped corpus, its byte-level BPE tokenizer and its token store (all
    in this process, no Ray): the data and evaluation tests' session fixtures are made with these
    (and with ``once``, for what is built from them), once per test run and set of arguments."""

    def __init__(self, factory) -> None:
        self.factory = factory

    def once(self, name: str, args: tuple, build: Callable[[str], None]) -> str:
        """``build_once`` keyed by ``name`` and the arguments that decide what is built."""
        key = hashlib.sha256(repr(args).encode()).hexdigest()[:12]
        return build_once(self.factory, f"{name}-{key}", build)

    def corpus(self, name: str, total_bytes: int, seed: int, domains: tuple[str, ...]) -> str:
        from marin.data.synthetic import SyntheticK40Config, generate_k40_miniature

        return self.once(name, (total_bytes, seed, domains), lambda root: generate_k40_miniature(
            SyntheticK40Config(root, total_bytes=total_bytes, seed=seed, domains=domains)))

    def tokenizer(self, name: str, corpus: str, vocab_size: int) -> str:
        from marin.data.tokenizer import TrainTokenizerConfig, train_tokenizer

        return self.once(name, (corpus, vocab_size), lambda out: train_tokenizer(
            TrainTokenizerConfig(corpus, out, vocab_size=vocab_size)))

    def store(self, name: str, corpus: str, tokenizer: str, **tokenize_kwargs) -> str:
        from marin.data.corpus_steps import CorpusInput
        from marin.data.tokenize import TokenizeConfig, tokenize

        local = CorpusInput(show_progress=False, use_ray=False)
        return self.once(name, (corpus, tokenizer, sorted(tokenize_kwargs.items())), lambda out: tokenize(
            TokenizeConfig(corpus, tokenizer, out, local, **tokenize_kwargs)))


@pytest.fixture(scope="session")
def k40_data(tmp_path_factory) -> K40Data:
    return K40Data(tmp_path_factory)


class HostLost(Exception):
    """What :func:`stop_after_checkpoint` raises inside the trainer, right after a checkpoint committed."""


@pytest.fixture()
def stop_after_checkpoint(monkeypatch) -> Callable[..., None]:
    """``stop_after_checkpoint(config, step)``: run training ``config`` in this process until its
    ``step`` checkpoint has committed, and stop it there, as a host lost right after a save stops a run
    (the checkpoint is on the store, nothing after it ran). The real save is back when it returns, so
    the next ``run_training(config)`` resumes from that checkpoint."""
    from marin.training.checkpoint import CheckpointManager
    from marin.training.trainer import run_training

    def run(config, step: int) -> None:
        real_save = CheckpointManager.save

        def save_then_stop(self, saved: int, *args, **kwargs):
            path = real_save(self, saved, *args, **kwargs)
            if saved == step:
                raise HostLost(f"stopped right after the step-{step} checkpoint")
            return path

        with monkeypatch.context() as patch:
            patch.setattr(CheckpointManager, "save", save_then_stop)
            with pytest.raises(HostLost):
                run_training(config, use_ray=False)

    return run



# The files that take longest in the default run, heaviest first (from `--durations`). With two
# workers each taking one file at a time, a heavy file dealt out last leaves the other worker idle at
# the end of the run; dealing them out first lets the light files fill the tail. Only the order
# changes, so a stale entry costs time, never a result.
HEAVIEST_FILES = (
    "tests/execution/test_signals.py",
    "tests/evaluation/test_use_run.py",
    "tests/training/test_multihost.py",
    "tests/training/test_pools.py",
    "tests/training/test_cuda_lowering.py",
    "tests/execution/test_faults_cli.py",
    "tests/models/test_decode.py",
    "tests/models/test_moe_transformer.py",
    "tests/execution/test_disk_full.py",
    "tests/training/test_fsdp.py",
    "tests/training/test_trainer.py",
    "tests/training/test_gate.py",
    "tests/evaluation/test_eval_step.py",
    "tests/training/test_storage_outage.py",
    "tests/training/test_planning.py",
    "tests/docs/test_docs_examples.py",
    "tests/test_messages.py",
    "tests/parallel/test_ep_transports.py",
    "tests/execution/test_executor.py",
)


# The same for the slow set (`make test-slow`), whose longest files take 9 to 15 minutes each on the
# 2-core machine: dealt out last, one of them would run alone for its whole length at the end.
HEAVIEST_SLOW_FILES = (
    "tests/scaling/test_tiny_isoflop.py",
    "tests/scaling/test_tiny_ladder.py",
    "tests/training/test_rack.py",
)


def pytest_collection_modifyitems(config, items):
    """Runs the heaviest files first (a stable sort: the rest keep their collection order); a slow
    test of one of the slow set's heaviest files goes before everything else."""
    rank = {path: i for i, path in enumerate(HEAVIEST_FILES)}
    slow_rank = {path: i for i, path in enumerate(HEAVIEST_SLOW_FILES)}

    def order(item) -> tuple[int, int]:
        path = item.nodeid.split("::", 1)[0]
        if path in slow_rank and item.get_closest_marker("slow") is not None:
            return 0, slow_rank[path]
        return 1, rank.get(path, len(rank))

    items.sort(key=order)
