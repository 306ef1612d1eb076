"""The experiment's DAG as an SVG drawing: layered by dependency depth, coloured by status.

Up to :data:`MAX_NODES` steps are drawn one node per step; larger experiments are drawn one node per
name prefix (``tokenized/harrier_k40/*``, with a count and a status bar), which keeps a 1,000-step
fan-out readable instead of a hairball.
"""

from __future__ import annotations

import dataclasses
import html
from collections.abc import Sequence

MAX_NODES = 150
COLORS = {"succeeded": "#2e9e44", "reused": "#8fcf9a", "failed": "#d83b3b", "running": "#2f7fd8",
          "interrupted": "#e59a1c", "not run": "#c9c9c9"}
NODE_W, NODE_H, COL_GAP, ROW_GAP = 172, 26, 30, 8


@dataclasses.dataclass
class Node:
    id: str
    """Anchor of the node's section in the report (``step-...`` or ``group-...``)."""
    label: str
    deps: list[str]
    categories: dict[str, int]
    """Status category -> number of steps (one entry with count 1 for a single step)."""
    title: str = ""


def layers(nodes: Sequence[Node]) -> dict[str, int]:
    """Longest-path depth of every node from the sources (deps outside ``nodes`` are ignored)."""
    ids = {n.id for n in nodes}
    by_id = {n.id: n for n in nodes}
    depth: dict[str, int] = {}
    for n in nodes:
        stack = [(n.id, False)]
        while stack:
            nid, expanded = stack.pop()
            if nid in depth:
                continue
            deps = [d for d in by_id[nid].deps if d in ids and d != nid]
            if expanded or all(d in depth for d in deps):
                depth[nid] = 1 + max((depth.get(d, 0) for d in deps), default=-1)
                continue
            stack.append((nid, True))
            stack.extend((d, False) for d in deps if d not in depth)
    return depth


def group_key(name: str, level: int) -> str:
    """``tokenized/harrier_k40/agri_q1`` -> ``tokenized/harrier_k40/*`` (level 1) or ``tokenized/*`` (level 2)."""
    parts = name.split("/")
    keep = max(1, len(parts) - level)
    return "/".join(parts[:keep]) + ("/*" if keep < len(parts) else "")


def group_nodes(nodes: Sequence[Node], names: dict[str, str]) -> tuple[list[Node], dict[str, str]]:
    """Merge nodes by name prefix until at most :data:`MAX_NODES` remain; also returns node -> group id."""
    level = 1
    while True:
        keys = {n.id: group_key(names[n.id], level) for n in nodes}
        if len(set(keys.values())) <= MAX_NODES or level > 8:
            break
        level += 1
    groups: dict[str, Node] = {}
    member_of: dict[str, str] = {}
    for n in nodes:
        key = keys[n.id]
        gid = "group-" + "".join(c if c.isalnum() or c in "-_" else "_" for c in key)
        member_of[n.id] = gid
        g = groups.setdefault(gid, Node(gid, key, [], {}, title=key))
        for c, k in n.categories.items():
            g.categories[c] = g.categories.get(c, 0) + k
    for n in nodes:
        g = groups[member_of[n.id]]
        for d in n.deps:
            gd = member_of.get(d)
            if gd and gd != g.id and gd not in g.deps:
                g.deps.append(gd)
    for g in groups.values():
        g.label = f"{g.label} ({sum(g.categories.values())})"
    return list(groups.values()), member_of


def draw(nodes: Sequence[Node]) -> str:
    """The SVG: one column per depth, nodes linked to their sections, edges as curves."""
    depth = layers(nodes)
    cols: dict[int, list[Node]] = {}
    for n in nodes:
        cols.setdefault(depth[n.id], []).append(n)
    row: dict[str, float] = {}
    for d in sorted(cols):  # order each column by the mean row of its inputs (fewer crossings)
        col = cols[d]
        if d > 0:
            col.sort(key=lambda n: sum(row.get(x, 0) for x in n.deps) / max(1, len([x for x in n.deps if x in row])))
        for i, n in enumerate(col):
            row[n.id] = i
    pos = {n.id: (20 + depth[n.id] * (NODE_W + COL_GAP), 20 + row[n.id] * (NODE_H + ROW_GAP)) for n in nodes}
    width = 40 + (max(cols) + 1) * (NODE_W + COL_GAP) - COL_GAP if cols else 100
    height = 40 + max((len(c) for c in cols.values()), default=1) * (NODE_H + ROW_GAP)
    out = [(f'<svg id="dag" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}">')]
    for n in nodes:
        x, y = pos[n.id]
        for d in n.deps:
            if d in pos:
                sx, sy = pos[d]
                sx, sy, ex, ey = sx + NODE_W, sy + NODE_H / 2, x, y + NODE_H / 2
                mx = (sx + ex) / 2
                out.append(f'<path class="edge" d="M{sx:.0f},{sy:.0f} C{mx:.0f},{sy:.0f} {mx:.0f},{ey:.0f} '
                           f'{ex:.0f},{ey:.0f}"/>')
    for n in nodes:
        x, y = pos[n.id]
        total = sum(n.categories.values()) or 1
        label = n.label if len(n.label) <= 30 else "…" + n.label[-29:]
        summary = ", ".join(f"{k} {c}" for c, k in n.categories.items())
        out.append(f'<a href="#{n.id}" class="node" data-node="{n.id}"><title>{html.escape(n.title or n.label)}: '
                   f'{html.escape(summary)}</title>')
        if len(n.categories) == 1 and total == 1:
            [cat] = n.categories
            out.append(f'<rect x="{x}" y="{y}" width="{NODE_W}" height="{NODE_H}" rx="5" '
                       f'fill="{COLORS.get(cat, "#c9c9c9")}" class="st-{cat.replace(" ", "-")}"/>')
        else:  # a group: a bar of status shares under the label
            out.append(f'<rect x="{x}" y="{y}" width="{NODE_W}" height="{NODE_H}" rx="5" fill="#f4f4f4" '
                       f'stroke="#888"/>')
            cx = x
            for cat, k in n.categories.items():
                w = NODE_W * k / total
                out.append(f'<rect x="{cx:.1f}" y="{y + NODE_H - 6}" width="{w:.1f}" height="6" '
                           f'fill="{COLORS.get(cat, "#c9c9c9")}"/>')
                cx += w
        out.append(f'<text x="{x + 6}" y="{y + 16}" class="nl">{html.escape(label)}</text></a>')
    out.append("</svg>")
    return "".join(out)
