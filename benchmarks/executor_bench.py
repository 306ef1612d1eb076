"""Executor benchmark: planning, first runs and no-op re-runs vs raw Ray tasks (same run, same machine).

    .venv/bin/python benchmarks/executor_bench.py [--steps 1000] [--plan-steps 10000]

Every pipeline timing is the whole `python experiment.py` process, import included, as a user would
time it. Both sides give each task the default one CPU that a step declaring no resources gets
(fractional CPUs would make Ray start one worker process per task and measure that instead).
The last line is one JSON object (keys documented in docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PIPELINE = textwrap.dedent(
    '''
    import dataclasses, sys
    from marin.execution import ExecutorStep, executor_main, output_path_of, this_output_path, versioned

    @dataclasses.dataclass(frozen=True)
    class Cfg:
        out: str
        inp: str | None
        i: int

    def work(cfg):
        value = 0
        if cfg.inp:
            with open(cfg.inp) as f:
                value = int(f.read())
        with open(cfg.out + "/value", "w") as f:
            f.write(str(value + 1))

    N, SHAPE = int(sys.argv.pop(1)), sys.argv.pop(1)
    steps, prev = [], None
    for i in range(N):
        inp = output_path_of(prev, "value") if (SHAPE == "chain" and prev is not None) else None
        prev = ExecutorStep(f"s{i}", work, Cfg(this_output_path(), inp, versioned(i)))  # default: 1 CPU
        steps.append(prev)
    executor_main(steps=steps, description=f"bench {SHAPE} {N}")
    '''
)

RAW_RAY = textwrap.dedent(
    '''
    import os, sys, tempfile
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    N, SHAPE, OUT = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    ray.init(address="local", include_dashboard=False, logging_level="WARNING")

    @ray.remote(num_cpus=1, max_retries=0)  # what an executor step gets when it declares nothing
    def work(i, prev_path):
        value = 0
        if prev_path:
            with open(prev_path) as f:
                value = int(f.read())
        os.makedirs(f"{OUT}/s{i}", exist_ok=True)
        path = f"{OUT}/s{i}/value"
        with open(path, "w") as f:
            f.write(str(value + 1))
        return path

    if SHAPE == "chain":
        ref = None
        for i in range(N):
            ref = work.remote(i, ref)
        ray.get(ref)
    else:
        ray.get([work.remote(i, None) for i in range(N)])
    '''
)


def timed(cmd: list[str], env: dict) -> float:
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    dt = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"command failed: {' '.join(cmd)}\n{r.stderr[-3000:]}")
    return dt


def file_create_ms(directory: str, n: int = 300) -> float:
    """CPU milliseconds to create one empty file in ``directory``: the dominant cost of a bookkeeping
    write on some disks (0.015 ms to 0.9 ms on one VM, depending on where on the disk the directory
    lies), and what makes the first-run ratios vary from run to run."""
    spent = 0.0
    for i in range(n):  # one new directory per file, as a step's bookkeeping does
        d = os.path.join(directory, "create-probe", str(i))
        os.makedirs(d)
        t0 = time.process_time()
        os.close(os.open(os.path.join(d, "f"), os.O_WRONLY | os.O_CREAT | os.O_EXCL))
        spent += time.process_time() - t0
    return spent / n * 1e3


def bench_plan(n: int) -> float:
    sys.path.insert(0, REPO)
    from marin.execution import ExecutorStep, output_path_of, plan_steps, this_output_path, versioned

    def work(cfg):
        pass

    t0 = time.perf_counter()
    prev = None
    steps = []
    for i in range(n):
        cfg = {"out": this_output_path(), "i": versioned(i), "lr": versioned(1e-3 * i),
               "inp": output_path_of(prev) if prev is not None else None}
        prev = ExecutorStep(f"s{i}", work, cfg)
        steps.append(prev)
    plan_steps(steps, "/tmp/bench-prefix")
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--plan-steps", type=int, default=10000)
    parser.add_argument("--scratch", default=None,
                        help="directory for the stores of both sides (default: the system temporary directory)")
    args = parser.parse_args()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", "PYTHONPATH": REPO}
    res: dict[str, float] = {}
    res["plan_10000_s"] = bench_plan(args.plan_steps)
    with tempfile.TemporaryDirectory(dir=args.scratch) as tmp:
        res["file_create_ms"] = file_create_ms(tmp)
        exp = os.path.join(tmp, "pipeline.py")
        raw = os.path.join(tmp, "raw_ray.py")
        open(exp, "w").write(PIPELINE)
        open(raw, "w").write(RAW_RAY)
        for shape in ("chain", "fanout"):
            prefix = os.path.join(tmp, f"store-{shape}")
            cmd = [sys.executable, exp, str(args.steps), shape, "--prefix", prefix, "--progress", "false"]
            res[f"first_{shape}_1000_s"] = timed(cmd, env)
            res[f"noop_{shape}_1000_s"] = timed(cmd, env)
            res[f"ray_{shape}_1000_s"] = timed([sys.executable, raw, str(args.steps), shape,
                                                os.path.join(tmp, f"raw-{shape}")], env)
    res["overhead_vs_ray"] = res["first_chain_1000_s"] / res["ray_chain_1000_s"]
    res["fanout_overhead_vs_ray"] = res["first_fanout_1000_s"] / res["ray_fanout_1000_s"]
    rows = [
        ("plan + hash, 10,000-step chain", res["plan_10000_s"], None, "< 2 s"),
        ("no-op re-run, 1,000 chain (process)", res["noop_chain_1000_s"], None, "< 2 s"),
        ("no-op re-run, 1,000 fan-out (process)", res["noop_fanout_1000_s"], None, "< 2 s"),
        ("first run, 1,000 chain", res["first_chain_1000_s"], res["ray_chain_1000_s"], "<= 1.5x raw Ray"),
        ("first run, 1,000 fan-out", res["first_fanout_1000_s"], res["ray_fanout_1000_s"], "<= 1.5x raw Ray"),
        ("raw Ray, 1,000 chain", res["ray_chain_1000_s"], None, "baseline"),
        ("raw Ray, 1,000 fan-out", res["ray_fanout_1000_s"], None, "baseline"),
    ]
    print(f"creating a file in the scratch directory costs {res['file_create_ms']:.3f} ms of CPU "
          "(a step's bookkeeping creates one: its lease, which becomes its status record)")
    print(f"{'measurement':40s} {'seconds':>9s} {'vs raw Ray':>11s}  target")
    for name, secs, base, target in rows:
        ratio = f"{secs / base:.2f}x" if base else "-"
        print(f"{name:40s} {secs:9.2f} {ratio:>11s}  {target}")
    print(json.dumps({k: round(v, 3) for k, v in res.items()}))


if __name__ == "__main__":
    main()
