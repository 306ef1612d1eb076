"""Where a path of documents splits into a tokenize step's input path and its source location."""

from __future__ import annotations

from marin.data.corpus_steps import split_glob


def test_split_glob_cuts_before_the_first_part_with_a_wildcard():
    def slow(path):  # the obvious way: walk the parts until one holds a wildcard
        parts = path.rstrip("/").split("/")
        for i, part in enumerate(parts):
            if "*" in part or "?" in part or "[" in part:
                return "/".join(parts[:i]), "/".join(parts[i:])
        return path, ""

    for path in ["gs://b/web/*/part-*.jsonl", "/data/docs.jsonl", "/data/dir/", "s3://b/x/shard-?.parquet",
                 "rel/[ab]/c.jsonl.zst", "*.jsonl"]:
        assert split_glob(path) == slow(path), path
    assert split_glob("gs://b/web/*/part-*.jsonl") == ("gs://b/web", "*/part-*.jsonl")
    assert split_glob("/data/dir/") == ("/data/dir/", "")
