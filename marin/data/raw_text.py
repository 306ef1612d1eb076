"""Raw text made from a K40-layout corpus: every record shuffled into a few flat files, so the domain and
quality structure is no longer in the paths, only in the text (and, for measuring a rebuilt layout, in
the records' own fields: the miniature's records carry their true ``domain`` and ``bucket``).

What the K40 build starts from when no crawl is at hand: the miniature corpus
(:mod:`marin.data.synthetic`) flattened by :func:`flatten_corpus`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from marin.data.corpus_steps import OutputFile, plan_files
from marin.data.layout import iter_raw_records
from marin.execution.versioning import input_field

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FlattenConfig:
    """Shuffle every record under ``input_path`` into ``files`` files ``part-NNNNN.jsonl.gz`` under
    ``output_path`` (deterministic in ``seed``)."""

    input_path: str = input_field()
    output_path: str = input_field()
    files: int = 4
    seed: int = 0


def flatten_corpus(config: FlattenConfig) -> None:
    """Executor step: the flat, shuffled copy (records byte for byte; a parquet row as a JSON line)."""
    if config.files < 1:
        raise ValueError(f"files must be at least 1, got {config.files}")
    out = config.output_path.rstrip("/")
    lines = [line for f in plan_files(config.input_path, out, None) for line in iter_raw_records(f.url)]
    order = np.random.default_rng(config.seed).permutation(len(lines))
    for part in range(config.files):
        o = OutputFile(f"{out}/part-{part:05d}.jsonl.gz")
        try:
            for i in order[part::config.files]:
                o.write(lines[i] + b"\n")
        finally:
            o.close()
    logger.info("flattened %d records of %s into %d files under %s", len(lines), config.input_path, config.files,
                out)
