"""Parameter and FLOP counts of a model preset (no JAX needed).

Print total and active parameters and training FLOPs per token of a MoE model preset. Counted as
the published figures count them (marin.models.config): "active" = the parameters a token's forward
multiplies through in the transformer blocks (attention with K/V as stored, norms, router, latent
projections, shared experts, top-k routed experts); embedding and output head excluded.
"""

from __future__ import annotations

import argparse
import json

from marin.models.config import PRESETS, PUBLISHED, get_preset, summary
from marin.textfmt import format_table


def _human(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("preset", choices=sorted(PRESETS), help="model preset name")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--seq-len", type=int, default=None,
                   help="sequence length for the attention FLOP term (default: the preset's max_seq_len)")


def run(args: argparse.Namespace) -> int:
    cfg = get_preset(args.preset)
    info = summary(cfg, args.seq_len)
    if args.json:
        print(json.dumps(info, sort_keys=True))
        return 0
    rows = [
        ("preset", args.preset),
        ("layers", info["layers"]),
        ("d_model", info["d_model"]),
        ("heads / kv heads", f"{info['n_heads']} / {info['n_kv_heads']}"
                             + (f" local, {info['n_kv_heads_global']} global"
                                if info["n_kv_heads_global"] != info["n_kv_heads"] else "")),
        ("sliding window", f"{info['sliding_window']:,} (every {info['global_every']}th layer and the last global)"),
        ("experts (top-k)", f"{info['num_experts']} (top-{info['top_k']}), width {info['expert_width']}"
                            + (f" (stored {info['stored_expert_width']})"
                               if info["stored_expert_width"] != info["expert_width"] else "") + ", "
                            f"latent {info['latent_dim']}, {info['n_shared_experts']} shared"),
        ("total params", f"{_human(info['total_params'])} ({info['total_params']:,})"),
        ("active params", f"{_human(info['active_params'])} ({info['active_params']:,})"),
        ("active + head", _human(info["active_params_with_head"])),
    ]
    pad = info["breakdown"]["kv_padding"]
    if pad:  # in both counts, as the published figures count it (docs/model.md, parameter accounting)
        rows.append(("K/V padding in both", f"{_human(pad)} (stored K/V columns a layer never reads; "
                                            f"not in the FLOPs)"))
    rows += [
        (f"train FLOPs/token @ {info['seq_len']}", f"{info['flops_per_token']:.4g}"),
    ]
    if args.preset in PUBLISHED:
        tot, act = PUBLISHED[args.preset]
        rows.append(("published total / active",
                     f"{_human(tot)} / {_human(act)} (ours {100 * (info['total_params'] / tot - 1):+.2f}% / "
                     f"{100 * (info['active_params'] / act - 1):+.2f}%)"))
    print(format_table((), rows))
    return 0

