"""``marin sample``, ``marin export`` and ``marin harness``: use a trained run's model.

    marin sample RUN_DIR --prompt TEXT [--prompt ...] [--step N] [--max-new-tokens 64] [--greedy]
                 [--temperature 1.0] [--top-k K] [--top-p P] [--seed S] [--pool P] [--json]
    marin export RUN_DIR -o DIR [--step N] [--overwrite] [--max-shard-size BYTES] [--pool P]
    marin harness RUN_DIR --tasks T1,T2 [--include-path DIR] [--output-path DIR] [--limit N]
                  [--step N] [--pool P]

RUN_DIR is a training step's output directory (local, s3://, gs://); ``--step`` picks a committed
checkpoint (default: the latest). The model runs in this process on the run's pool, or on
``--pool`` (a single-host pool, e.g. local-cpu-1).
"""

from __future__ import annotations

import argparse
import json
import sys


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", help="training step output directory (local, s3://, gs://)")
    p.add_argument("--step", type=int, default=None, help="committed checkpoint step (default: the latest)")
    p.add_argument("--pool", default=None, help="single-host device pool to run on (default: the run's)")


def sample_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="marin sample", description="Continue text prompts with a run's model "
                                "(KV-cache decoding, prompts of different lengths batched together).")
    _common(p)
    p.add_argument("--prompt", action="append", default=[], required=True, help="prompt text; repeatable")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt (default 64)")
    p.add_argument("--greedy", action="store_true", help="take the most likely token every time (deterministic)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature, > 0 (default 1.0)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the K most likely tokens")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling: the smallest set with probability P")
    p.add_argument("--seed", type=int, default=0, help="random seed: the same seed gives the same samples")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def export_parser() -> argparse.ArgumentParser:
    from marin.inference.export import DEFAULT_MAX_SHARD_BYTES

    p = argparse.ArgumentParser(prog="marin export", description="Write a run's weights as safetensors shards with "
                                "model.safetensors.index.json, config.json, tokenizer.json, a numpy reference "
                                "forward (reference_forward.py) and a model card (README.md).")
    _common(p)
    p.add_argument("-o", "--output", required=True, help="directory to write (must be empty or new)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    p.add_argument("--max-shard-size", type=int, default=DEFAULT_MAX_SHARD_BYTES,
                   help=f"bytes per safetensors shard (default {DEFAULT_MAX_SHARD_BYTES})")
    return p


def harness_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="marin harness", description="Run lm-evaluation-harness tasks on a run's model "
                                "(lm_eval's own evaluation with marin's model class); writes lm_eval's results JSON.")
    _common(p)
    p.add_argument("--tasks", required=True, help="comma-separated task names (from --include-path or lm_eval's own)")
    p.add_argument("--include-path", default=None, help="directory of task YAML files (local data, no hub access)")
    p.add_argument("--output-path", default=None, help="directory to write results.json into")
    p.add_argument("--limit", type=int, default=None, help="at most N documents per task")
    p.add_argument("--json", action="store_true", help="print lm_eval's results object")
    return p


def _fail(prog: str, e: BaseException) -> int:
    msg = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
    print(f"marin {prog}: error: {msg.splitlines()[0] if msg else type(e).__name__}", file=sys.stderr)
    return 2


def sample_main(argv: list[str]) -> int:
    from marin.inference import generate, load_run

    args = sample_parser().parse_args(argv)
    try:
        from marin.models.sampling import Sampling

        Sampling(greedy=args.greedy, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)  # check early
        run = load_run(args.run, args.step, args.pool)
        texts = generate(run, args.prompt, max_new_tokens=args.max_new_tokens, greedy=args.greedy,
                         temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    except (FileNotFoundError, ValueError, KeyError) as e:
        return _fail("sample", e)
    if args.json:
        print(json.dumps({"step": run.step, "samples": [{"prompt": p, "completion": t}
                                                        for p, t in zip(args.prompt, texts)]}))
        return 0
    for p, t in zip(args.prompt, texts):
        bold, plain = ("\033[1m", "\033[0m") if sys.stdout.isatty() else ("", "")
        print(f"--- step {run.step} ---\n{p}{bold}{t}{plain}")
    return 0


def export_main(argv: list[str]) -> int:
    from marin.inference import load_run
    from marin.inference.export import check_output_dir, export_run

    args = export_parser().parse_args(argv)
    try:
        if not args.overwrite:
            check_output_dir(args.output, False)  # refuse before loading anything
        run = load_run(args.run, args.step, args.pool)
        res = export_run(run, args.output, overwrite=args.overwrite, max_shard_bytes=args.max_shard_size)
    except (FileNotFoundError, ValueError, KeyError) as e:
        return _fail("export", e)
    print(f"exported step {run.step} of {args.run} to {res['dir']}: {res['tensors']} tensors in {res['shards']} "
          f"shard(s), {res['total_size']:,} bytes")
    return 0


def harness_main(argv: list[str]) -> int:
    from marin.inference.harness import run_harness

    args = harness_parser().parse_args(argv)
    try:
        results = run_harness(args.run, [t for t in args.tasks.split(",") if t], step=args.step, pool=args.pool,
                              include_path=args.include_path, output_path=args.output_path, limit=args.limit)
    except (FileNotFoundError, ValueError, KeyError) as e:
        return _fail("harness", e)
    if args.json:
        print(json.dumps(results["results"], default=str))
        return 0
    from marin.evaluation.harness import format_results

    print(format_results(results))
    return 0
