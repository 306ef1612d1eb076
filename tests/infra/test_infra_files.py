"""The cluster definitions in infra/ parse, carry the required fields and fit the pool presets."""

import contextlib
import importlib.util
import io
import json
import os
import re
import shlex

import pytest
import yaml

from marin.pools import POOLS, RACK_LABEL, get_pool

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
INFRA = os.path.join(REPO, "infra")


def _load(name):
    with open(os.path.join(INFRA, name)) as f:
        return yaml.safe_load(f)


def _gb200_nodes(manifest):
    """Ray's view of the KubeRay cluster: one dict of resources + labels per worker pod."""
    nodes = []
    for group in manifest["spec"]["workerGroupSpecs"]:
        params = group["rayStartParams"]
        labels = dict(kv.split("=", 1) for kv in params.get("labels", "").split(",") if kv)
        res = {"CPU": float(params["num-cpus"]), "GPU": float(params.get("num-gpus", 0))}
        res.update(json.loads(params.get("resources", "{}").strip("'\"") or "{}"))
        nodes += [{"resources": res, "labels": labels} for _ in range(group["replicas"])]
    return nodes


def _fits(pool, nodes):
    """Can each rack of ``pool`` get hosts_per_rack distinct nodes, all with one rack label?"""
    bundle = pool.bundle()
    ok = [n for n in nodes if all(n["resources"].get(k, 0) >= v for k, v in bundle.items())]
    by_rack = {}
    for n in ok:
        by_rack.setdefault(n["labels"].get(pool.rack_label) if pool.rack_label else None, []).append(n)
    racks_needed = pool.racks
    for members in by_rack.values():
        racks_needed -= len(members) // pool.hosts_per_rack
    return racks_needed <= 0


def _render_module():
    # in-process (no fork after JAX may have started threads in this test process)
    spec = importlib.util.spec_from_file_location("render_gb200", os.path.join(INFRA, "render_gb200.py"))
    render = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render)
    return render


def _render(*argv):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        _render_module().main(list(argv))
    return buf.getvalue()


def test_gb200_manifest_is_generated_from_pools():
    out = _render()
    with open(os.path.join(INFRA, "gb200-nvl72-raycluster.yaml")) as f:
        assert f.read() == out, "regenerate: python infra/render_gb200.py > infra/gb200-nvl72-raycluster.yaml"


def test_gb200_manifest_fields_and_rack_layout():
    m = _load("gb200-nvl72-raycluster.yaml")
    assert m["apiVersion"] == "ray.io/v1" and m["kind"] == "RayCluster"
    spec = m["spec"]
    assert spec["rayVersion"] == "2.60.0"
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    assert spec["headGroupSpec"]["template"]["spec"]["containers"]
    hero = get_pool("gb200-11racks")
    groups = spec["workerGroupSpecs"]
    assert len(groups) == hero.racks == 11
    racks = set()
    for g in groups:
        assert g["replicas"] == g["minReplicas"] == g["maxReplicas"] == hero.hosts_per_rack == 16
        p = g["rayStartParams"]
        assert int(p["num-gpus"]) == hero.devices_per_host == 4
        assert int(p["num-cpus"]) >= hero.cpus_per_host
        [container] = g["template"]["spec"]["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == p["num-gpus"]
        key, rack = p["labels"].split("=")
        assert key == RACK_LABEL
        assert g["template"]["spec"]["nodeSelector"]["nvidia.com/gpu.clique"] == rack
        racks.add(rack)
    assert len(racks) == 11
    nodes = _gb200_nodes(m)
    assert sum(n["resources"]["GPU"] for n in nodes) == hero.num_devices == 704
    # as published: EP 64 per rack, DP 11
    assert hero.devices_per_rack == hero.mesh[1] == 64 and hero.mesh[0] == 11


@pytest.mark.parametrize("pool_name", ["gb200-rack", "gb200-11racks"])
def test_gb200_pools_fit_the_cluster(pool_name):
    assert _fits(get_pool(pool_name), _gb200_nodes(_load("gb200-nvl72-raycluster.yaml")))


def test_fit_check_rejects_a_pool_too_big():
    import dataclasses

    big = dataclasses.replace(get_pool("gb200-11racks"), name="x", hosts=12 * 16, racks=12, mesh=(12, 64))
    assert not _fits(big, _gb200_nodes(_load("gb200-nvl72-raycluster.yaml")))


def _start_args(command: str) -> dict:
    args = shlex.split(command.split("ray start", 1)[1])
    out = {}
    for a in args:
        if a.startswith("--"):
            k, _, v = a[2:].partition("=")
            out[k] = v if v else True
    return out


def test_local_cluster_definition():
    c = _load("local-cluster.yaml")
    assert c["provider"]["type"] == "local" and c["provider"]["head_ip"]
    assert c["cluster_name"]
    [head] = [cmd for cmd in c["head_start_ray_commands"] if "ray start" in cmd]
    head_args = _start_args(head)
    assert head_args["head"] is True and head_args["port"] == "6379"
    [worker] = [cmd for cmd in c["worker_start_ray_commands"] if "ray start" in cmd]
    worker_args = _start_args(worker)
    assert worker_args["address"].endswith(":6379")
    head_node = {"resources": {"CPU": float(head_args["num-cpus"]), **json.loads(head_args["resources"])},
                 "labels": dict([head_args["labels"].split("=")])}
    worker_node = {"resources": {"CPU": float(worker_args["num-cpus"]), **json.loads(worker_args["resources"])},
                   "labels": dict([worker_args["labels"].split("=")])}
    # single-host CPU pools fit the head alone; local-2host needs the head plus one worker
    for name, pool in POOLS.items():
        if pool.is_cpu and pool.hosts == 1:
            assert _fits(pool, [head_node]), name
    assert not _fits(get_pool("local-2host"), [head_node])
    assert _fits(get_pool("local-2host"), [head_node, worker_node])


def test_readme_says_how_to_start_and_connect():
    text = open(os.path.join(INFRA, "README.md")).read()
    for needle in ("ray up infra/local-cluster.yaml", "kubectl apply -f infra/gb200-nvl72-raycluster.yaml",
                   "marin run --address", "RAY_ADDRESS"):
        assert needle in text
    assert re.search(r"marin\.io/rack", text)


def test_render_puts_the_given_image_into_every_container():
    m = yaml.safe_load(_render("--image", "registry.example.com/lab/marin:abc123"))
    pods = [m["spec"]["headGroupSpec"]["template"]] + [g["template"] for g in m["spec"]["workerGroupSpecs"]]
    images = {c["image"] for p in pods for c in p["spec"]["containers"]}
    assert images == {"registry.example.com/lab/marin:abc123"}
    # the default is the image infra/Dockerfile builds, not someone else's
    default = yaml.safe_load(_render())
    assert default["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["image"] == "marin:latest"


def test_render_rejects_a_bad_image(capsys):
    with pytest.raises(SystemExit):
        _render("--image", "my image")
    assert "--image must be an image reference without spaces" in capsys.readouterr().err


def _pyproject():
    import tomllib

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def _pin(requirements, name):
    """The ==version of ``name`` (extras ignored) in a list of requirement strings."""
    for r in requirements:
        m = re.fullmatch(rf"{re.escape(name)}(\[[^\]]*\])?==([\w.]+)", r.strip())
        if m:
            return m.group(2)
    raise AssertionError(f"{name} is not pinned with == in {requirements}")


def test_dockerfile_pins_agree_with_pyproject():
    text = open(os.path.join(INFRA, "Dockerfile")).read()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, flags=re.M))
    project = _pyproject()["project"]
    extras = project["optional-dependencies"]
    # the Ray base image is the pinned Ray version (and the generated cluster says the same)
    assert args["RAY_VERSION"] == _pin(project["dependencies"], "ray") == _render_module().RAY_VERSION
    # one file, two architectures: Ray's image of each (ARM64 for GB200's Grace hosts, AMD64 for
    # H100/H200 hosts), picked by BuildKit's TARGETARCH
    bases = dict((arch, image) for image, arch in re.findall(r"^FROM (\S+) AS base-(\w+)$", text, flags=re.M))
    assert bases == {"amd64": "rayproject/ray:${RAY_VERSION}-${PYTHON_TAG}-${CUDA_TAG}",
                     "arm64": "rayproject/ray:${RAY_VERSION}-${PYTHON_TAG}-${CUDA_TAG}-aarch64"}, bases
    assert re.search(r"^ARG TARGETARCH$", text, flags=re.M) and re.search(r"^FROM base-\$\{TARGETARCH\}$", text,
                                                                          flags=re.M)
    assert "--platform linux/arm64,linux/amd64" in text  # the build command in its header builds both
    # the base image's Python is the one the project supports
    py = re.search(r">=\s*3\.(\d+)", project["requires-python"]).group(1)
    assert args["PYTHON_TAG"] == f"py3{py}"
    assert args["CUDA_TAG"].startswith("cu")
    # the image installs the project with the all and gpu extras
    assert re.search(r"pip install [^\n]*-e '\.\[all,gpu\]'", text)
    # the gpu extra is jax's CUDA build of the same jax version as the CPU pin
    assert _pin(extras["gpu"], "jax") == _pin(extras["train"], "jax") == _pin(extras["train"], "jaxlib")
    assert any(r.startswith("jax[cuda13]") for r in extras["gpu"])
    # NCCL no older than the release the ragged transport first ran with across GB200 racks
    (nccl,) = [re.fullmatch(r"nvidia-nccl-cu13>=(\d+)\.(\d+)\.(\d+)", r) for r in extras["gpu"] if "nccl" in r]
    assert nccl and tuple(map(int, nccl.groups())) >= (2, 30, 7), extras["gpu"]
    # the README's commands build the virtual environment on that same Python
    make = open(os.path.join(REPO, "Makefile")).read()
    assert re.search(rf"^PY_VERSION := 3\.{py}$", make, flags=re.M)
    assert project["requires-python"] == f">=3.{py},<3.{int(py) + 1}"
    for name in ("marin", "experiments", "pyproject.toml"):
        assert re.search(rf"^COPY [^\n]*\b{re.escape(name)}\b", text, flags=re.M), name
