"""A run's weights as safetensors shards with config, tokenizer and model card.

Writes model-0000K-of-0000N.safetensors shards of a bounded size, model.safetensors.index.json
(the Hugging Face sharded layout), config.json (the resolved model config, marin's version, the
run's lineage), tokenizer.json, reference_forward.py (the model in numpy alone) and README.md (a
model card). A non-empty output directory is refused unless --overwrite. See docs/use.md.
"""

from __future__ import annotations

import argparse

from marin.commands import options
from marin.commands.sample import add_run_arguments
from marin.inference import load_run
from marin.inference.export import DEFAULT_MAX_SHARD_BYTES, check_output_dir, export_run


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_run_arguments(p)
    p.add_argument("-o", "--output", required=True, help="directory to write (must be empty or new)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    p.add_argument("--max-shard-size", type=options.positive_int, default=DEFAULT_MAX_SHARD_BYTES,
                   help=f"bytes per safetensors shard (default {DEFAULT_MAX_SHARD_BYTES})")


def run(args: argparse.Namespace) -> int:
    if not args.overwrite:
        check_output_dir(args.output, False)  # refuse before loading anything
    loaded = load_run(args.run, args.step, args.pool)
    res = export_run(loaded, args.output, overwrite=args.overwrite, max_shard_bytes=args.max_shard_size)
    print(f"exported step {loaded.step} of {args.run} to {res['dir']}: {res['tensors']} tensors in {res['shards']} "
          f"shard(s), {res['total_size']:,} bytes")
    return 0
