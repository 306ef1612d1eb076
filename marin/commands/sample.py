"""Continue text prompts with a training run's model.

KV-cache decoding of a run's committed checkpoint (default: the latest), prompts of different
lengths batched together, on the run's pool or another (--pool). On a pool of several hosts every
host loads only its own slices of the checkpoint and decodes its share of one program, one JAX
process per host (the pool launcher training uses); a local CPU pool's hosts are simulated on this
machine unless --address joins a cluster. --greedy takes the most likely token each time
(deterministic); otherwise tokens are sampled at --temperature (with optional --top-k / --top-p),
reproducibly for a given --seed. See docs/use.md.
"""

from __future__ import annotations

import argparse
import json
import sys

from marin.commands import options
from marin.execution.errors import ExecutorError
from marin.inference import generate_with_ids, load_run
from marin.inference.multihost import run_pool, sample_text_on_pool
from marin.models.sampling import Sampling  # JAX-free: a bad setting is refused before JAX starts
from marin.pools import PoolLaunchError


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """RUN_DIR, --step and --pool: what every command that uses a run's model takes."""
    p.add_argument("run", help="training step output directory (local, s3://, gs://)")
    p.add_argument("--step", type=int, default=None, help="committed checkpoint step (default: the latest)")
    p.add_argument("--pool", default=None, help="device pool to run on (default: the run's)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_run_arguments(p)
    options.add_address(p)
    p.add_argument("--prompt", action="append", default=[], required=True, help="prompt text; repeatable")
    p.add_argument("--max-new-tokens", type=options.positive_int, default=64,
                   help="tokens to generate per prompt (default 64)")
    p.add_argument("--greedy", action="store_true", help="take the most likely token every time (deterministic)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature, > 0 (default 1.0)")
    p.add_argument("--top-k", type=options.positive_int, default=None, help="sample among the K most likely tokens")
    p.add_argument("--top-p", type=options.fraction, default=None,
                   help="nucleus sampling: the smallest set with probability P")
    p.add_argument("--seed", type=int, default=0, help="random seed: the same seed gives the same samples")
    options.add_json(p)


def run(args: argparse.Namespace) -> int:
    sampling = Sampling(greedy=args.greedy, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                        seed=args.seed)  # refused here, before JAX starts
    pool = run_pool(args.run, args.step, args.pool)
    if pool.hosts > 1:
        try:
            step, texts, tokens = sample_text_on_pool(args.run, args.step, pool, args.prompt,
                                                      max_new_tokens=args.max_new_tokens, sampling=sampling,
                                                      address=args.address, say=_note)
        except (PoolLaunchError, ExecutorError) as e:  # the pool's own message, whose first line says why
            print(f"marin: error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
            return 2
    else:
        loaded = load_run(args.run, args.step, pool.name)
        step = loaded.step
        texts, tokens = generate_with_ids(loaded, args.prompt, max_new_tokens=args.max_new_tokens,
                                          greedy=args.greedy, temperature=args.temperature, top_k=args.top_k,
                                          top_p=args.top_p, seed=args.seed)
    if args.json:
        print(json.dumps({"step": step, "samples": [{"prompt": p, "completion": t, "tokens": ids}
                                      for p, t, ids in zip(args.prompt, texts, tokens)]}))
        return 0
    bold, plain = ("\033[1m", "\033[0m") if sys.stdout.isatty() else ("", "")
    for p, t in zip(args.prompt, texts):
        print(f"--- step {step} ---\n{p}{bold}{t}{plain}")
    return 0


def _note(line: str) -> None:
    print(f"marin sample: {line}", file=sys.stderr, flush=True)
