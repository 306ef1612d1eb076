"""A run's weights as safetensors shards with config, tokenizer and model card.

Writes model-0000K-of-0000N.safetensors shards of a bounded size (bfloat16 by default, --dtype
float32), model.safetensors.index.json (the Hugging Face sharded layout), config.json (the resolved
model config, marin's version, the run's lineage), tokenizer.json, reference_forward.py (the model in
numpy alone) and README.md (a model card). The checkpoint is streamed, slice by slice, without JAX;
--processes N writes shards from N processes, and an interrupted export, rerun, continues. A
non-empty output directory is refused unless --overwrite, which writes the new export beside it and
replaces it only once complete (a failed export leaves the old one as it was); an output that is,
holds or lies inside the run, or any step's output, is refused. --dry-run says what it would write
and hold. See docs/use.md.
"""

from __future__ import annotations

import argparse

import fsspec

from marin.commands import options
from marin.commands.sample import add_run_arguments
from marin.inference.export import (
    DEFAULT_DTYPE,
    DEFAULT_MAX_SHARD_BYTES,
    ExportError,
    check_destination,
    export_checkpoint,
    export_estimate,
    model_readers,
    refuse_credentials,
    storage_reason,
)
from marin.inference.run import load_verified_checkpoint
from marin.models.exported import EXPORT_DTYPES
from marin.textfmt import format_bytes
from marin.training.checkpoint.format import read_index
from marin.training.run import Run


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_run_arguments(p)
    p.add_argument("-o", "--output", required=True, help="directory to write (local, s3://, gs://; must be empty "
                   "or new, or hold an unfinished export to continue)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory (once the new "
                   "export is complete; never the run itself or another step's output)")
    p.add_argument("--max-shard-size", type=options.positive_int, default=DEFAULT_MAX_SHARD_BYTES,
                   help=f"bytes per safetensors shard (default {DEFAULT_MAX_SHARD_BYTES})")
    p.add_argument("--dtype", choices=EXPORT_DTYPES, default=DEFAULT_DTYPE,
                   help=f"tensor type of the export (default {DEFAULT_DTYPE})")
    p.add_argument("--processes", type=options.positive_int, default=1,
                   help="worker processes writing shards in parallel (default 1; each holds about one shard)")
    p.add_argument("--dry-run", action="store_true", help="say how many shards and bytes it would write and the "
                   "host memory it would use, and write nothing")


def run(args: argparse.Namespace) -> int:
    if args.dry_run:
        return _dry_run(args)
    res = export_checkpoint(args.run, args.output, step=args.step, dtype=args.dtype,
                            max_shard_bytes=args.max_shard_size, processes=args.processes, overwrite=args.overwrite)
    how = " (continued an interrupted export)" if res["resumed"] else ""
    print(f"exported step {res['step']} of {args.run} to {res['dir']}: {res['tensors']} tensors in {res['shards']} "
          f"shard(s), {res['total_size']:,} bytes of {args.dtype}{how}")
    return 0


def _dry_run(args: argparse.Namespace) -> int:
    refuse_credentials(args.output)
    def estimate(step: int) -> tuple[int, dict[str, int]]:
        path = Run(args.run).checkpoint_path(step)
        cfg = model_readers(path)[0]
        remote = "://" in args.output and not args.output.startswith("file://")
        return step, export_estimate(cfg, read_index(path)["leaves"], dtype=args.dtype,
                                     max_shard_bytes=args.max_shard_size, processes=args.processes, remote=remote)

    step, (_, est) = load_verified_checkpoint(args.run, args.step, estimate)
    check_destination(args.output, args.run)
    try:
        fs, root = fsspec.core.url_to_fs(args.output)
        busy = fs.isdir(root) and fs.ls(root, detail=False)
    except Exception as e:  # noqa: BLE001 - whatever the store says, the answer is one line
        raise ExportError(f"cannot reach {args.output}: {storage_reason(e)}") from None
    print(f"would export step {step} of {args.run} to {args.output}: {est['tensors']} tensors in {est['shards']} "
          f"shard(s), {format_bytes(est['bytes'])} of {args.dtype}, with at most {format_bytes(est['host_bytes'])} of "
          f"host memory over {args.processes} process(es); no JAX device needed"
          + (f" ({args.output} is not empty: pass --overwrite or continue an unfinished export)" if busy else ""))
    return 0
