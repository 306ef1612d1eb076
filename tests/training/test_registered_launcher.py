"""A launcher registered in an experiment file reaches the Ray worker that launches the pool: the pool
names it ``"module:kind"`` and the worker imports the module, which registers it there too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from marin.pools import get_pool
from marin.pools.errors import PoolLaunchError
from marin.pools.launcher import launcher_of

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

EXPERIMENT = '''
    """A site's experiment file: its own launcher (marin's Ray launcher that first leaves a mark in the
    step's directory), registered here, and a step that launches a pool of that kind."""
    import dataclasses, json, os

    from marin.execution import ExecutorStep, executor_main, this_output_path
    from marin.pools import RayLauncher, get_pool, launch, register_launcher


    class MarkingLauncher(RayLauncher):
        def launch(self, pool, fn, args, **kw):
            with open(os.path.join(kw["step_dir"], "launched-by.json"), "w") as f:
                json.dump({"launcher": f"{type(self).__module__}.{type(self).__qualname__}", "pid": os.getpid()}, f)
            return super().launch(pool, fn, args, **kw)


    register_launcher("marking", MarkingLauncher())


    @dataclasses.dataclass(frozen=True)
    class PoolStepConfig:
        out: str = dataclasses.field(default_factory=this_output_path)


    def host(ctx):
        return {"process_id": ctx.process_id, "pid": os.getpid()}


    def run_on_pool(cfg):
        pool = dataclasses.replace(get_pool("local-cpu"), launcher="site_exp:marking")
        results = launch(pool, host, step_dir=cfg.out)
        with open(os.path.join(cfg.out, "hosts.json"), "w") as f:
            json.dump({"hosts": results, "step_pid": os.getpid()}, f)


    step = ExecutorStep("site/pool-step", run_on_pool, PoolStepConfig())
    if __name__ == "__main__":
        with open("driver.pid", "w") as f:
            f.write(str(os.getpid()))
        executor_main(steps=[step])
'''


@pytest.mark.slow  # an experiment run in its own process, with its own local Ray cluster: about a minute
def test_a_launcher_registered_in_an_experiment_file_launches_the_pool_in_the_ray_worker(tmp_path):
    folder = tmp_path / "site"
    folder.mkdir()
    (folder / "site_exp.py").write_text(textwrap.dedent(EXPERIMENT))
    prefix = tmp_path / "store"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, str(folder)]), "RAY_USAGE_STATS_ENABLED": "0"}
    proc = subprocess.run([sys.executable, "site_exp.py", "--prefix", str(prefix)], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [step_dir] = list((prefix / "site").glob("pool-step-*"))
    launched = json.loads((step_dir / "launched-by.json").read_text())
    hosts = json.loads((step_dir / "hosts.json").read_text())
    # the worker imported the experiment file as the module the pool names, whose import registered it
    assert launched["launcher"] == "site_exp.MarkingLauncher"
    driver = int((folder / "driver.pid").read_text())
    assert launched["pid"] == hosts["step_pid"] != driver  # the Ray worker running the step launched it
    assert [h["process_id"] for h in hosts["hosts"]] == [0] and hosts["hosts"][0]["pid"] != hosts["step_pid"]


def test_a_launcher_that_cannot_be_found_is_one_line_naming_the_fix():
    import dataclasses

    pool = get_pool("local-cpu")
    with pytest.raises(PoolLaunchError) as e:
        launcher_of(dataclasses.replace(pool, launcher="slurm"))
    assert str(e.value) == ("pool local-cpu: no launcher 'slurm' in this process (known: ray); a launcher registered "
                            "elsewhere is named with its module, launcher = \"<module>:slurm\"")
    with pytest.raises(PoolLaunchError) as e:
        launcher_of(dataclasses.replace(pool, launcher="marin.no_such_site:slurm"))
    assert str(e.value).startswith("pool local-cpu: launcher 'marin.no_such_site:slurm': importing marin.no_such_site "
                                   "failed in this process (ModuleNotFoundError: No module named 'marin.no_such_site')")
    with pytest.raises(PoolLaunchError) as e:
        launcher_of(dataclasses.replace(pool, launcher="marin.pools.spec:slurm"))
    assert str(e.value) == ("pool local-cpu: importing marin.pools.spec registered no launcher 'slurm' (known: ray); "
                            "it must call register_launcher('slurm', ...) when imported")
    assert launcher_of(dataclasses.replace(pool, launcher="marin.pools.launcher:ray")) is launcher_of(pool)
    assert "\n" not in str(e.value)
