"""The module tables of the docs list every module of their package, and no module that is gone.

A table whose header starts with ``| module |`` documents a package: its first column names modules
as ``marin/pkg/mod.py`` (any package) or as a bare ``mod.py`` of the package the text just above
the table names (```marin.execution``` or ```marin/review/```). Each package below must have every
module (``__init__.py`` aside, a package's own file) in one of its doc's tables.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

DOCUMENTED = {"execution": "docs/architecture.md", "review": "docs/architecture.md",
              "training": "docs/training.md", "evaluation": "docs/evaluation.md",
              "pools": "docs/training.md"}
"""Package -> the doc whose module tables list it."""


def _tables(text: str) -> list[tuple[str | None, list[str]]]:
    """``(package the text above names, first cells)`` of each ``| module |`` table."""
    out = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("| module |"):
            above = "\n".join(lines[max(0, i - 6):i])
            named = re.findall(r"`marin[./]([a-z_]+)/?`", above)
            cells = []
            i += 2  # the header and its rule
            while i < len(lines) and lines[i].startswith("|"):
                cells.append(lines[i].split("|")[1])
                i += 1
            out.append((named[-1] if named else None, cells))
        i += 1
    return out


def _listed(doc: str) -> set[str]:
    """Module paths (``marin/pkg/mod.py``) the doc's module tables name."""
    out = set()
    for package, cells in _tables((REPO / doc).read_text()):
        for cell in cells:
            for name in re.findall(r"`([^`]+\.py)`", cell):
                if name.startswith("marin/"):
                    out.add(name)
                elif package is not None:
                    out.add(f"marin/{package}/{name}")
    return out


def test_every_module_is_in_its_package_table_and_every_listed_module_exists():
    problems = []
    for package, doc in sorted(DOCUMENTED.items()):
        listed = _listed(doc)
        modules = {str(p.relative_to(REPO)) for p in (REPO / "marin" / package).rglob("*.py")}
        for module in sorted(modules - listed):
            if not module.endswith("/__init__.py"):
                problems.append(f"{doc} lists no {module}")
        for module in sorted(m for m in listed if m.startswith(f"marin/{package}/") and m not in modules):
            problems.append(f"{doc} lists {module}, which does not exist")
    for doc in sorted(set(DOCUMENTED.values())):
        problems += [f"{doc} lists {m}, which does not exist" for m in sorted(_listed(doc))
                     if not (REPO / m).is_file() and m.split("/")[1] not in DOCUMENTED]
    assert not problems, "module tables out of date:\n  " + "\n  ".join(problems)


def test_the_heros_compute_quoted_in_the_training_guide_is_what_marin_plan_prints(capsys):
    """docs/training.md quotes the hero's plan; the numbers follow the planner when it changes."""
    import json

    from marin.cli import main

    assert main(["plan", "hero", "--pool", "gb200-11racks", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    text = (REPO / "docs" / "training.md").read_text()
    flops, days = re.search(r"18\.00T tokens, ([\d.]+e24) FLOPs, about ([\d.]+) days at 21% MFU", text).groups()
    assert f"{plan['train_flops']:.2e}".replace("e+", "e") == flops and f"{plan['days']:.1f}" == days


def test_the_ladders_share_of_the_heros_compute_quoted_in_the_scaling_guide_is_what_the_planner_gives():
    """docs/scaling.md quotes the production ladder against the hero; the numbers follow the rungs,
    the hero's schedule and the FLOP count when any of them changes."""
    from experiments.hero import HERO_STEPS, HERO_TOKENS_PER_STEP
    from experiments.ladder import HERO, HERO_FLOPS, RUNGS
    from marin.models.config import count_params

    text = " ".join((REPO / "docs" / "scaling.md").read_text().split())
    got = re.search(r"keeps the ladder at ([\d.]+)% of the hero's ([\d.]+e24) FLOPs, but gives the assumed rungs "
                    r"about (\d+) and (\d+) training tokens per active parameter, against about (\d+)-(\d+) for the "
                    r"published rungs \((\d+) for the hero\).*?at (\d+) that is about (\d+)% of the hero's compute",
                    text).groups()
    share, flops, *per_param, at, at_share = got
    per = {r.name: r.tokens / r.active_params for r in RUNGS}
    assumed = [round(per[r.name]) for r in RUNGS if not r.budget_published]
    published = sorted(round(per[r.name]) for r in RUNGS if r.budget_published)
    hero = round(HERO_STEPS * HERO_TOKENS_PER_STEP / count_params(HERO)["active_params"])
    assert share == f"{100 * sum(r.flops for r in RUNGS) / HERO_FLOPS:.2f}"
    assert flops == f"{HERO_FLOPS:.2e}".replace("e+", "e")
    assert [int(x) for x in per_param] == [*assumed, *published, hero]
    rebudgeted = sum(r.flops * (1 if r.budget_published else int(at) / per[r.name]) for r in RUNGS)
    assert at_share == f"{100 * rebudgeted / HERO_FLOPS:.0f}"
