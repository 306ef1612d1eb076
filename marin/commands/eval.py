"""Bits per byte of a training run's checkpoint on text you point it at.

    marin eval RUN_DIR [--data NAME=PATH_OR_GLOB ...] [--task NAME=PATH ...] [--held-out]
                       [--step N] [--stride S] [--pool POOL] [--address ADDR] [--json]

RUN_DIR is a training step's output directory. Each ``--data`` is a file, directory or glob of
jsonl / jsonl.gz / jsonl.zst / parquet documents (any fsspec path), tokenized here with the run's
tokenizer, or an existing token store (checked against the run's tokenizer). Each ``--task`` is a
multiple-choice jsonl file (context, choices, gold). Without ``--data`` and ``--task`` (or with
``--held-out``) the run's mixture held-out split is evaluated too. The checkpoint is evaluated
on the run's pool unless ``--pool`` names another: in this process on a pool of one host; on a pool
of several hosts one JAX process per host (the pool launcher training uses), each reading only its
own slices of the checkpoint, on the Ray cluster at ``--address`` (or ``$RAY_ADDRESS``) or, for a
local CPU pool, on simulated nodes started on this machine for the command.

``--step N`` picks the checkpoint, as in ``marin sample``, ``export`` and ``harness`` (default: the
newest that verifies); ``--checkpoint N`` is accepted as an older spelling of it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from typing import Any

import fsspec

from marin.commands import options
from marin.data.corpus_steps import CorpusInput, split_glob
from marin.data.store import MANIFEST, TokenStore
from marin.data.tokenize import TokenizeConfig, TokenizeError, tokenize
from marin.evaluation.sets import EvalSet
from marin.execution.errors import ExecutorError
from marin.inference.evaluate import EvalConfig, run_eval
from marin.inference.run import prepare_devices
from marin.pools import PoolLaunchError, get_pool, pool_cluster
from marin.textfmt import format_table
from marin.training.run import Run


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", help="training step output directory (local, s3://, gs://)")
    p.add_argument("--data", action="append", default=[], metavar="NAME=PATH_OR_GLOB",
                   help="an eval set: documents (file, directory, glob) or a token store; repeatable")
    p.add_argument("--task", action="append", default=[], metavar="NAME=PATH",
                   help="a multiple-choice task (jsonl of context, choices, gold); repeatable")
    p.add_argument("--held-out", action="store_true", help="also evaluate the run's mixture held-out split")
    p.add_argument("--step", "--checkpoint", dest="step", default="latest", metavar="N",
                   help="committed checkpoint step (default: the latest); --checkpoint is an older spelling")
    p.add_argument("--stride", type=int, default=None, help="window stride in tokens (default: disjoint windows)")
    p.add_argument("--pool", default=None, help="device pool to evaluate on (default: the run's)")
    options.add_address(p)
    p.add_argument("--text-field", default="text", help="document field holding the text (default: text)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _parse_data(items: list[str], flag: str = "--data") -> list[tuple[str, str]]:
    out = []
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"{flag} {item!r}: expected NAME=PATH")
        if any(n == name for n, _ in out):
            raise ValueError(f"{flag}: the name {name!r} is given twice")
        out.append((name, path))
    return out


def _tokenize_set(name: str, path: str, tokenizer: str, text_field: str, workdir: str) -> str:
    """A token store of the documents at ``path`` (tokenized here), or ``path`` itself if it is one."""
    if _is_store(path):
        return path
    fs, p = fsspec.core.url_to_fs(path)
    base, loc = split_glob(path)
    if not loc and not fs.exists(p):
        raise FileNotFoundError(f"--data {name}: no such file or directory: {path}")
    out = os.path.join(workdir, name.replace("/", "__"))
    try:
        tokenize(TokenizeConfig(base, tokenizer, out, CorpusInput(sources={name: loc}, text_field=text_field,
                                                                  show_progress=False, use_ray=False)))
    except TokenizeError as e:  # say it about the user's file, not the temporary store being built
        raise ValueError(f"--data {name}: cannot score {path}: {_tokenize_reason(str(e), out)}") from None
    return out


def _tokenize_reason(message: str, workdir: str) -> str:
    """A tokenize error as one line about the input: the per-file reasons when it lists them, without
    its advice about the (temporary) store's shards or the step's allow_empty setting."""
    lines = [ln.strip() for ln in message.splitlines() if ln.strip()]
    reason = "; ".join(lines[1:]) if len(lines) > 1 else lines[0] if lines else "tokenizing failed"
    reason = re.sub(r" \((?:finished work is|the shards are) kept[^)]*\)", "", reason)
    reason = re.sub(r",? or set CorpusInput\(allow_empty=True\)(?: if an empty output is what you want)?", "", reason)
    reason = reason.replace(workdir, "<temporary store>")
    return reason


def evaluate(args: argparse.Namespace) -> dict[str, Any]:
    checkpoint: str | int = args.step if args.step == "latest" else _step(args.step)

    run = Run(args.run)
    if not run.exists:
        raise FileNotFoundError(f"no training run at {args.run}: the path does not exist (pass a training step's "
                                "output directory; `marin status` lists them)")
    steps = run.select(checkpoint)
    train_config = run.config(steps[-1])
    pool = get_pool(args.pool) if args.pool else train_config.pool
    address = args.address or os.environ.get("RAY_ADDRESS")
    if pool.hosts > 1 and address and any(not _is_store(path) for _, path in _parse_data(args.data)):
        raise ValueError(f"pool {pool.name} has {pool.hosts} hosts on the cluster at {address}: --data must name token "
                         "stores every host can read (tokenize the documents with an experiment's tokenize step)")
    if pool.hosts == 1:
        prepare_devices(pool)  # fake CPU devices must be requested before JAX starts
    data = _parse_data(args.data)
    tasks = dict(_parse_data(args.task, "--task"))
    stores = getattr(train_config.data, "stores", None)
    if (data or tasks) and not stores:
        raise ValueError(f"{args.run} was trained on synthetic tokens (no tokenizer); it cannot score text")
    with tempfile.TemporaryDirectory(prefix="marin-eval-") as work:
        tokenizer = TokenStore.open(stores[0]).manifest["tokenizer"]["path"] if stores else None
        sets = tuple(EvalSet(name, _tokenize_set(name, path, tokenizer, args.text_field, work)) for name, path in data)
        config = EvalConfig(args.run, "", sets=sets, checkpoint=checkpoint,
                            held_out=args.held_out or not (data or tasks), pool=pool.name, stride=args.stride,
                            tasks=tasks)
        with pool_cluster(pool, args.address, _note) as on_ray:
            return run_eval(config, use_ray=on_ray)


def _is_store(path: str) -> bool:
    fs, p = fsspec.core.url_to_fs(path)
    return fs.isfile(f"{p.rstrip('/')}/{MANIFEST}")


def _note(line: str) -> None:
    print(f"marin eval: {line}", file=sys.stderr, flush=True)


def _step(x: str) -> int:
    try:
        return int(x)
    except ValueError:
        raise ValueError(f"--step must be a step number (or 'latest'), got {x!r}") from None


def summary_json(result: dict[str, Any]) -> dict[str, Any]:
    """The ``--json`` object: per-set documents, tokens, bytes, loss, bpb; macro, micro; step."""
    keys = ("documents", "tokens", "bytes", "loss", "bpb")
    out: dict[str, Any] = {}
    if "sets" in result:
        out = {"sets": {n: {k: m[k] for k in keys} for n, m in result["sets"].items()},
               "macro_bpb": result["macro_bpb"], "micro_bpb": result["micro_bpb"]}
    out["step"] = result["step"]
    if "tasks" in result:
        out["tasks"] = result["tasks"]
    return out


def format_result(result: dict[str, Any]) -> str:
    lines = [f"checkpoint {result['checkpoint']} (step {result['step']})"]
    if "sets" in result:
        lines += ["", _sets_table(result)]
    for name, t in result.get("tasks", {}).items():
        lines.append(f"task {name}: acc {t['acc']:.3f}  acc_norm {t['acc_norm']:.3f}  "
                     f"(chance {t['chance']:.3f}, {t['questions']} questions)")
    return "\n".join(lines)


def _sets_table(result: dict[str, Any]) -> str:
    rows = [(n, m["documents"], m["tokens"], m["bytes"], f"{m['loss']:.4f}", f"{m['bpb']:.4f}")
            for n, m in result["sets"].items()]
    lines = [format_table(("set", "documents", "tokens", "bytes", "loss", "bpb"), rows, right=range(1, 6), rule=False)]
    lines += [
        "",
        (
            f"macro bpb {result['macro_bpb']:.4f} over {len(result['sets'])} "
            f"set{'s' if len(result['sets']) != 1 else ''}   "
            f"micro bpb {result['micro_bpb']:.4f}"
        ),
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        result = evaluate(args)
    except (FileNotFoundError, ValueError, KeyError, TokenizeError, PoolLaunchError, ExecutorError) as e:
        msg = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
        print(f"marin eval: error: {msg.splitlines()[0] if msg else type(e).__name__}", file=sys.stderr)
        return 2
    print(json.dumps(summary_json(result)) if args.json else format_result(result))
    return 0
