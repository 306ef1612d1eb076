"""Quickstart: a small real pipeline on the embedded defaults (local Ray, local disk).

    python experiments/quickstart.py --prefix ./local_store     # or: marin run experiments/quickstart.py

Steps: generate documents -> shard them -> count words per shard (fan-out) -> summarize.
Run it twice: the second run finds every step's SUCCESS and does nothing.
"""

from __future__ import annotations

import dataclasses
import json
import random

import fsspec

from marin.execution import ExecutorStep, executor_main, output_path_of, this_output_path, versioned


@dataclasses.dataclass(frozen=True)
class GenerateConfig:
    output_path: str
    num_documents: int = 2000
    seed: int = 0


def generate_documents(config: GenerateConfig) -> None:
    """Write ``num_documents`` pseudo-random documents as JSONL."""
    rng = random.Random(config.seed)
    words = ["expert", "router", "token", "layer", "shard", "ladder", "mixture", "domain", "quality", "step"]
    with fsspec.open(f"{config.output_path}/documents.jsonl", "w") as f:
        for i in range(config.num_documents):
            text = " ".join(rng.choice(words) for _ in range(rng.randint(5, 50)))
            f.write(json.dumps({"id": i, "text": text}) + "\n")


@dataclasses.dataclass(frozen=True)
class ShardConfig:
    input_path: str
    output_path: str
    num_shards: int = 4


def shard_documents(config: ShardConfig) -> None:
    """Split the documents round-robin into ``num_shards`` JSONL shards."""
    with fsspec.open(config.input_path) as f:
        lines = f.read().decode().splitlines()
    for k in range(config.num_shards):
        with fsspec.open(f"{config.output_path}/shard-{k:03d}.jsonl", "w") as out:
            out.write("\n".join(lines[k :: config.num_shards]) + "\n")


@dataclasses.dataclass(frozen=True)
class CountConfig:
    shard_path: str
    output_path: str


def count_words(config: CountConfig) -> None:
    counts: dict[str, int] = {}
    with fsspec.open(config.shard_path) as f:
        for line in f.read().decode().splitlines():
            for w in json.loads(line)["text"].split():
                counts[w] = counts.get(w, 0) + 1
    with fsspec.open(f"{config.output_path}/counts.json", "w") as out:
        json.dump(counts, out, sort_keys=True)


@dataclasses.dataclass(frozen=True)
class SummaryConfig:
    count_paths: list[str]
    output_path: str


def summarize(config: SummaryConfig) -> None:
    total: dict[str, int] = {}
    for p in config.count_paths:
        with fsspec.open(p) as f:
            for w, n in json.load(f).items():
                total[w] = total.get(w, 0) + n
    with fsspec.open(f"{config.output_path}/summary.json", "w") as out:
        json.dump({"total_words": sum(total.values()), "by_word": total}, out, indent=1, sort_keys=True)
    print(f"summary: {sum(total.values())} words over {len(config.count_paths)} shards")


NUM_SHARDS = 4

documents = ExecutorStep(
    name="quickstart/documents",
    fn=generate_documents,
    config=GenerateConfig(output_path=this_output_path(), num_documents=versioned(2000), seed=versioned(0)),
    description="Synthetic documents",
)
shards = ExecutorStep(
    name="quickstart/shards",
    fn=shard_documents,
    config=ShardConfig(
        input_path=output_path_of(documents, "documents.jsonl"),
        output_path=this_output_path(),
        num_shards=versioned(NUM_SHARDS),
    ),
)
counts = [
    ExecutorStep(
        name=f"quickstart/counts-{k}",
        fn=count_words,
        config=CountConfig(shard_path=output_path_of(shards, f"shard-{k:03d}.jsonl"), output_path=this_output_path()),
    )
    for k in range(NUM_SHARDS)
]
summary = ExecutorStep(
    name="quickstart/summary",
    fn=summarize,
    config=SummaryConfig(count_paths=[output_path_of(c, "counts.json") for c in counts], output_path=this_output_path()),
)

if __name__ == "__main__":
    executor_main(steps=[summary], description="Quickstart: documents -> shards -> counts -> summary")
