"""How long ``marin report`` takes, and how big the file is, for a large experiment.

    python benchmarks/report_bench.py [--steps 1000] [--records 400000]

Builds (once, in a temporary directory, with the executor's own record-keeping functions) an
experiment of ``--steps`` succeeded steps in 20 name groups plus one training step whose
metrics.jsonl holds ``--records`` records (the hero run's step count), then times:

- the report of the 1,000-step experiment (targets: < 5 s, < 5 MB);
- the report of the training step with 400,000 records (downsampled plots);
- baseline, in the same run: reading every step's status and info (what ``marin status`` reads),
  the least a report of these steps has to do.

Prints a table with the ratios and a last JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "tests", "review")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--records", type=int, default=400_000)
    args = ap.parse_args()

    from review_fixtures import _finish, _succeed, build_fanout, noop

    import marin.review as mr
    from marin.execution import ExecutorStep, plan_steps, this_output_path, versioned
    from marin.review.report import render
    from marin.review.steps import row_for, step_dirs

    res: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        fan = os.path.join(tmp, "fan")
        build_fanout(fan, args.steps)

        t = time.perf_counter()
        for d in step_dirs(fan):
            row_for(d)
        res["baseline_read_status_s"] = time.perf_counter() - t

        t = time.perf_counter()
        html = render(mr.load(prefix=fan))
        res["report_1000_steps_s"] = time.perf_counter() - t
        res["report_1000_steps_mb"] = len(html.encode()) / 1e6

        long_prefix = os.path.join(tmp, "long")
        train = ExecutorStep("hero/train", noop, {"train_steps": versioned(args.records), "out": this_output_path()})
        plan = plan_steps([train], long_prefix)
        [ps] = plan.steps
        lease, rec = _succeed(ps, plan)
        with open(f"{ps.output_path}/metrics.jsonl", "w") as f:
            f.writelines(
                json.dumps(
                    {
                        "step": i,
                        "loss": 2 + 8 * math.exp(-i / 20000),
                        "grad_norm": 0.3 + (5.0 if i == 123_457 else 0),
                        "lr": 1e-4,
                        "drop_frac_send": 0.01,
                        "drop_frac_recv": 0.012,
                        "expert_load_max": 1.3,
                        "expert_load_mean": 1.1,
                        "tokens_per_s": 1e6,
                        "mfu": 0.4,
                        "tokens": 46_137_344 * i,
                        "seq_len": 4096 if i < 200_000 else 8192,
                        "transport": "fixed" if i < 81_716 else "dropless",
                    }
                )
                + "\n"
                for i in range(1, args.records + 1)
            )
        _finish(ps, lease, rec)
        t = time.perf_counter()
        long_html = render(mr.load(prefix=long_prefix))
        res["report_400k_records_s"] = time.perf_counter() - t
        res["report_400k_records_mb"] = len(long_html.encode()) / 1e6
        assert "5" in long_html  # the spike's value is on the grad-norm axis

    res["report_vs_status_read"] = res["report_1000_steps_s"] / res["baseline_read_status_s"]
    rows = [
        (f"read status+info of {args.steps} steps (baseline)", res["baseline_read_status_s"], "", "baseline"),
        (f"report, {args.steps} steps", res["report_1000_steps_s"], f"{res['report_1000_steps_mb']:.2f} MB",
         "< 5 s, < 5 MB"),
        (f"report, training step with {args.records:,} records", res["report_400k_records_s"],
         f"{res['report_400k_records_mb']:.2f} MB", ""),
    ]
    print(f"{'measurement':52s} {'seconds':>8s} {'size':>9s} {'vs baseline':>11s}  target")
    for name, secs, size, target in rows:
        print(f"{name:52s} {secs:8.2f} {size:>9s} {secs / res['baseline_read_status_s']:10.1f}x  {target}")
    print(json.dumps({k: round(v, 3) for k, v in res.items()}))


if __name__ == "__main__":
    main()
