"""Executor benchmark: planning, first runs and no-op re-runs vs raw Ray tasks (same run, same machine).

    .venv/bin/python benchmarks/executor_bench.py [--steps 1000] [--plan-steps 10000] [--rounds 3]

Every pipeline timing is the whole `python experiment.py` process, import included, as a user would
time it. Both sides give each task the default one CPU that a step declaring no resources gets
(fractional CPUs would make Ray start one worker process per task and measure that instead).
A last run of each shape times every part of the driver's work (``BREAKDOWN``: records, leases,
step info, submission, Ray's start and stop) and prints it per step.
The last line is one JSON object (keys documented in docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

from marin.execution.reaper import processes_with_env

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
    import json, os, sys, tempfile, time
    T0 = time.perf_counter()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    N, SHAPE, OUT = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    T1 = time.perf_counter()
    ray.init(address="local", include_dashboard=False, logging_level="WARNING")
    T2 = time.perf_counter()

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
    PHASES = {"import": T1 - T0, "Ray start": T2 - T1, "tasks": time.perf_counter() - T2}
    print("PHASES " + json.dumps(PHASES), file=sys.stderr)  # Ray stops at exit (its atexit hook)
    '''
)


BREAKDOWN = textwrap.dedent(
    '''
    """Runs an experiment file (argv[1], its flags after it) with a timer around each part of the
    driver's work; prints one JSON line to stderr: part -> [seconds in the driver's main thread, calls]."""
    import json, runpy, sys, threading, time

    T0 = time.perf_counter()
    import marin.execution.executor as ex
    from marin.execution import lease, main, status
    import ray
    IMPORTED = time.perf_counter()

    spent, calls, depth = {}, {}, [0]

    def timer(owner, name, part):
        fn = getattr(owner, name, None)
        if fn is None:  # an executor from before the part had this name
            return
        def timed(*args, **kwargs):
            if threading.current_thread() is not threading.main_thread() or depth[0]:
                return fn(*args, **kwargs)  # the heartbeat's renewals, or a part inside another part
            depth[0] += 1
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
                spent[part] = spent.get(part, 0.0) + time.perf_counter() - t
                calls[part] = calls.get(part, 0) + 1
        setattr(owner, name, timed)

    def timer_cm(owner, name, part):  # a context manager: its entry and exit count, not its body
        fn = getattr(owner, name, None)
        if fn is None:
            return
        class Timed:
            def __init__(self, *args, **kwargs):
                self.cm = fn(*args, **kwargs)
            def __enter__(self):
                t = time.perf_counter()
                try:
                    return self.cm.__enter__()
                finally:
                    spent[part] = spent.get(part, 0.0) + time.perf_counter() - t
                    calls[part] = calls.get(part, 0) + 1
            def __exit__(self, *exc):
                t = time.perf_counter()
                try:
                    return self.cm.__exit__(*exc)
                finally:
                    spent[part] = spent.get(part, 0.0) + time.perf_counter() - t
        setattr(owner, name, Timed)

    timer_cm(ex, "fenced", "leases")
    timer_cm(lease, "fenced", "leases")  # an executor that called it through the lease module
    import ray.remote_function
    timer(ray.remote_function.RemoteFunction, "_remote", "submission")  # inside submit, or called directly
    for owner, name, part in [
        (main, "plan_steps", "plan"), (ex, "run_statuses", "read statuses"), (ex, "read_statuses", "read statuses"),
        (ex, "ensure_ray", "Ray start"), (ex, "shutdown_local_ray", "Ray stop"),
        (ex, "write_experiment_record", "experiment record"),
        (ex, "resolve_config", "step info"), (ex, "step_info", "step info"),
        (lease, "try_acquire", "leases"), (lease, "release", "leases"),
        (status, "read_status", "status records"), (status, "write_status", "status records"),
        (ex, "submit", "submission"), (ray, "wait", "waiting for Ray"), (ray, "get", "waiting for Ray"),
    ]:
        timer(owner, name, part)

    script = sys.argv.pop(1)
    sys.argv[0] = script
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        total = time.perf_counter() - T0
        parts = {"import": [IMPORTED - T0, 1], **{k: [spent[k], calls[k]] for k in spent}}
        parts["other (driver loop)"] = [total - sum(v[0] for v in parts.values()), 0]
        print("BREAKDOWN " + json.dumps(parts), file=sys.stderr)
    '''
)
"""The driver's time by part: the parts a step's bookkeeping has (its records, its lease, its
submission) and the run's fixed costs (Ray's start and stop, the experiment record)."""


def breakdown(exp: str, steps: int, shape: str, prefix: str, env: dict, tmp: str) -> dict[str, list[float]]:
    """Seconds (and calls) per part of one first run, from :data:`BREAKDOWN`."""
    wrapper = os.path.join(tmp, "breakdown.py")
    with open(wrapper, "w") as f:
        f.write(BREAKDOWN)
    tag = f"{os.getpid()}-{time.monotonic_ns()}"
    r = subprocess.run([sys.executable, wrapper, exp, str(steps), shape, "--prefix", prefix, "--progress", "false"],
                       env={**env, RUN_MARKER: tag}, capture_output=True, text=True)
    settle(tag)
    line = next((x for x in r.stderr.splitlines() if x.startswith("BREAKDOWN ")), None)
    if r.returncode != 0 or line is None:
        raise SystemExit(f"breakdown run failed:\n{r.stderr[-3000:]}")
    return json.loads(line[len("BREAKDOWN "):])


RUN_MARKER = "MARIN_BENCH_RUN"
"""Set in each measured process's environment (and so in every process its Ray cluster starts), to
find what a run left running."""

SETTLE_S = 20.0

leftovers_seen: list[int] = []
"""How many processes each measured run left running after it exited."""


def processes_of(tag: str) -> list[int]:
    """Pids of live processes whose environment carries ``RUN_MARKER=tag``."""
    return list(processes_with_env(f"{RUN_MARKER}={tag}"))


def settle(tag: str) -> None:
    """Wait (up to :data:`SETTLE_S`) for the processes a measured run left behind, then stop the
    rest: plain Ray exits without waiting for its cluster (its dashboard and runtime-env agents
    outlive the driver by minutes), and on a 2-core machine they would slow whichever run comes
    next. The executor stops its own cluster, agents included, inside its measured time."""
    left = processes_of(tag)
    leftovers_seen.append(len(left))
    deadline = time.monotonic() + SETTLE_S
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = processes_of(tag)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def timed(cmd: list[str], env: dict) -> float:
    """Seconds of one process, ``cmd``; what it left running is stopped before the next (:func:`settle`)."""
    tag = f"{os.getpid()}-{time.monotonic_ns()}"
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env={**env, RUN_MARKER: tag}, capture_output=True, text=True)
    dt = time.perf_counter() - t0
    settle(tag)
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


def raw_phases(raw: str, steps: int, shape: str, out: str, env: dict) -> dict[str, float]:
    """Seconds of plain Ray's import, start and tasks in one run; the rest of its process time, its
    stop at exit (Ray's atexit hook) and the interpreter's own start and exit, as "Ray stop, exit"."""
    tag = f"{os.getpid()}-{time.monotonic_ns()}"
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, raw, str(steps), shape, out], env={**env, RUN_MARKER: tag},
                       capture_output=True, text=True)
    total = time.perf_counter() - t0
    settle(tag)
    line = next((x for x in r.stderr.splitlines() if x.startswith("PHASES ")), None)
    if r.returncode != 0 or line is None:
        raise SystemExit(f"raw Ray run failed:\n{r.stderr[-3000:]}")
    phases = json.loads(line[len("PHASES "):])
    phases["Ray stop, exit"] = total - sum(phases.values())
    return phases


def print_breakdown(shape: str, parts: dict[str, list[float]], steps: int) -> None:
    """The driver's time of one first run by part, in seconds and per step."""
    total = sum(v[0] for v in parts.values())
    print(f"where the driver's time goes, first run of {steps:,} {shape} steps ({total:.2f} s, main thread):")
    for part, (secs, _) in sorted(parts.items(), key=lambda kv: -kv[1][0]):
        print(f"  {part:28s} {secs:7.2f} s  {secs / steps * 1e3:6.2f} ms/step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--plan-steps", type=int, default=10000)
    parser.add_argument("--rounds", type=int, default=1,
                        help="first runs of each side, alternated (executor, Ray, executor, ...): ratios as a range")
    parser.add_argument("--shapes", default="chain,fanout", help="comma-separated: chain, fanout")
    parser.add_argument("--no-breakdown", action="store_true", help="skip the run that times each part of the driver")
    parser.add_argument("--scratch", default=None,
                        help="directory for the stores of both sides (default: the system temporary directory)")
    args = parser.parse_args()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", "PYTHONPATH": REPO}
    shapes = args.shapes.split(",")
    res: dict[str, float] = {}
    ratios: dict[str, list[float]] = {shape: [] for shape in shapes}
    parts: dict[str, dict[str, list[float]]] = {}
    raw_parts: dict[str, dict[str, float]] = {}
    res["plan_10000_s"] = bench_plan(args.plan_steps)
    with tempfile.TemporaryDirectory(dir=args.scratch) as tmp:
        res["file_create_ms"] = file_create_ms(tmp)
        exp = os.path.join(tmp, "pipeline.py")
        raw = os.path.join(tmp, "raw_ray.py")
        open(exp, "w").write(PIPELINE)
        open(raw, "w").write(RAW_RAY)
        for r in range(args.rounds):
            for shape in shapes:
                prefix = os.path.join(tmp, f"store-{shape}-{r}")
                cmd = [sys.executable, exp, str(args.steps), shape, "--prefix", prefix, "--progress", "false"]
                first = timed(cmd, env)
                noop = timed(cmd, env)
                ray = timed([sys.executable, raw, str(args.steps), shape, os.path.join(tmp, f"raw-{shape}-{r}")], env)
                ratios[shape].append(first / ray)
                if r == 0 or first / ray <= min(ratios[shape]):  # the JSON keeps the best round's times
                    res.update({f"first_{shape}_1000_s": first, f"noop_{shape}_1000_s": noop,
                                f"ray_{shape}_1000_s": ray})
        if not args.no_breakdown:
            for shape in shapes:
                parts[shape] = breakdown(exp, args.steps, shape, os.path.join(tmp, f"store-{shape}-breakdown"), env,
                                         tmp)
                raw_parts[shape] = raw_phases(raw, args.steps, shape, os.path.join(tmp, f"raw-{shape}-breakdown"), env)
    for shape, key in (("chain", "overhead_vs_ray"), ("fanout", "fanout_overhead_vs_ray")):
        if shape in shapes:
            res[key] = min(ratios[shape])
            res[f"{key}_max"] = max(ratios[shape])
    rows = [(f"plan + hash, {args.plan_steps:,}-step chain", res["plan_10000_s"], None, "< 2 s")]
    for shape, label in (("chain", "chain"), ("fanout", "fan-out")):
        if shape in shapes:
            n = f"{args.steps:,}"
            rows += [(f"no-op re-run, {n} {label} (process)", res[f"noop_{shape}_1000_s"], None, "< 2 s"),
                     (f"first run, {n} {label}", res[f"first_{shape}_1000_s"], res[f"ray_{shape}_1000_s"],
                      "<= 1.2x raw Ray"),
                     (f"raw Ray, {n} {label}", res[f"ray_{shape}_1000_s"], None, "baseline")]
    print(f"processes a measured run left running after it exited (stopped before the next run): "
          f"{leftovers_seen}")
    print(f"creating a file in the scratch directory costs {res['file_create_ms']:.3f} ms of CPU "
          "(a step's bookkeeping creates one: its lease, which becomes its status record)")
    print(f"{'measurement':40s} {'seconds':>9s} {'vs raw Ray':>11s}  target")
    for name, secs, base, target in rows:
        ratio = f"{secs / base:.2f}x" if base else "-"
        print(f"{name:40s} {secs:9.2f} {ratio:>11s}  {target}")
    for shape in shapes:
        print(f"first run / raw Ray, {shape}, {args.rounds} alternated round(s): "
              + ", ".join(f"{x:.2f}x" for x in ratios[shape]))
    for shape, p in parts.items():
        print_breakdown(shape, p, args.steps)
        print(f"  plain Ray, the same {shape} (the next run): "
              + ", ".join(f"{k} {v:.2f} s" for k, v in raw_parts[shape].items()))
    out = {k: round(v, 3) for k, v in res.items()}
    for shape, p in parts.items():
        out[f"{shape}_ms_per_step"] = {k: round(v[0] / args.steps * 1e3, 3) for k, v in p.items()}
        out[f"ray_{shape}_ms_per_step"] = {k: round(v / args.steps * 1e3, 3) for k, v in raw_parts[shape].items()}
    print(json.dumps(out))

if __name__ == "__main__":
    main()
