"""Tokenizers: train a byte-level BPE as a step, or load any ``tokenizer.json`` through fsspec.

Nothing here talks to a model hub: a tokenizer is a JSON file at a path (local, s3://, gs://). Its
*identity* is the sha256 of its canonical JSON (keys sorted, no whitespace), so the same tokenizer
saved twice, or pretty-printed differently, has one identity, and any change to vocab, merges or
special tokens gives a new one. Token stores record that identity; reading with another is an error.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import fsspec

from marin.data.readers import (
    DEFAULT_MAX_CORRUPT_FRACTION,
    DEFAULT_ON_CORRUPT,
    CorruptInputError,
    TooManyCorruptFilesError,
    corrupt_policy_violation,
    iter_documents,
    list_document_files,
    validate_corrupt_policy,
)
from marin.execution.versioning import input_field, live

logger = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
DEFAULT_EOS = "<|endoftext|>"


class TokenizerError(ValueError):
    """A tokenizer file is missing, unreadable, or lacks the end-of-document token."""


def tokenizer_json_path(path: str) -> str:
    """Accept either a ``tokenizer.json`` file or a directory holding one (a tokenizer step's output)."""
    path = path.rstrip("/")
    return path if path.endswith(".json") else f"{path}/{TOKENIZER_FILE}"


def tokenizer_identity(json_text: str) -> str:
    """sha256 (hex) of the canonical form of a tokenizer's JSON."""
    canonical = json.dumps(json.loads(json_text), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class LoadedTokenizer:
    """A tokenizer plus the facts the token store needs about it."""

    tokenizer: object  # tokenizers.Tokenizer (kept untyped so this module imports without it)
    identity: str
    path: str
    eos_token: str
    eos_id: int
    vocab_size: int

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, without special tokens, without the end-of-document token."""
        encs = self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        return [e.ids for e in encs]

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(map(int, ids)), skip_special_tokens=False)


def load_tokenizer_from_json(json_text: str, path: str = "<memory>", eos_token: str = DEFAULT_EOS) -> LoadedTokenizer:
    """Build a :class:`LoadedTokenizer` from JSON text (checks the end-of-document token exists)."""
    from tokenizers import Tokenizer  # tokenizers: the data extra, only when a tokenizer is read

    try:
        tok = Tokenizer.from_str(json_text)
    except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
        raise TokenizerError(f"{path}: not a valid tokenizer.json ({e})") from e
    eos_id = tok.token_to_id(eos_token)
    if eos_id is None:
        raise TokenizerError(
            f"{path}: end-of-document token {eos_token!r} is not in the vocabulary; "
            "pass eos_token= with the tokenizer's own end-of-text token"
        )
    # Text that happens to contain the literal EOS string must not become an EOS id: the store
    # marks document ends with EOS and the loader derives segment ids from it.
    tok.encode_special_tokens = True
    return LoadedTokenizer(
        tokenizer=tok,
        identity=tokenizer_identity(json_text),
        path=path,
        eos_token=eos_token,
        eos_id=int(eos_id),
        vocab_size=int(tok.get_vocab_size(with_added_tokens=True)),
    )


@functools.lru_cache(maxsize=8)
def _load_cached(path: str, eos_token: str) -> LoadedTokenizer:
    jpath = tokenizer_json_path(path)
    try:
        with fsspec.open(jpath, "r", encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError as e:
        raise TokenizerError(f"tokenizer not found: {jpath}") from e
    return load_tokenizer_from_json(text, path=jpath, eos_token=eos_token)


def load_tokenizer(path: str, eos_token: str = DEFAULT_EOS) -> LoadedTokenizer:
    """Load ``tokenizer.json`` (or a directory holding it) from any fsspec path. Cached per process."""
    return _load_cached(path, eos_token)


# --------------------------------------------------------------------------------------------------
# Training step


@dataclass(frozen=True)
class TrainTokenizerConfig:
    """Train a byte-level BPE on (a sample of) a corpus laid out as jsonl/parquet files.

    input_path: a root (e.g. a K40 miniature) searched recursively for document files.
    output_path: directory that receives ``tokenizer.json``.
    """

    input_path: str = input_field()
    output_path: str = input_field()
    vocab_size: int = 8192
    max_bytes: int = 50_000_000
    """Stop reading the corpus after this many bytes of text (a tokenizer needs a sample, not all)."""
    text_field: str = "text"
    min_frequency: int = 2
    eos_token: str = DEFAULT_EOS
    on_corrupt: str = DEFAULT_ON_CORRUPT
    """"skip": leave a corrupt file out (recorded in tokenizer_info.json) while at most
    ``max_corrupt_fraction`` of the files are corrupt; "fail": stop on the first corrupt file."""
    max_corrupt_fraction: float = DEFAULT_MAX_CORRUPT_FRACTION
    allow_small_vocab: bool = live("whether a tokenizer with fewer entries than vocab_size may succeed, not what "
                                   "the step writes", default=False)
    """A corpus too small (or empty) to learn ``vocab_size`` entries fails the step unless this is True."""


def _sample_texts(config: TrainTokenizerConfig, report: dict) -> Iterator[str]:
    """Each file's share of the byte budget, file after file, so a budget still sees every source.

    A file's texts are held back until the file has been read up to its share without damage, so a
    skipped corrupt file contributes nothing (not the part before the damage). ``report`` receives
    the file count and the skipped files."""

    validate_corrupt_policy(config.on_corrupt, config.max_corrupt_fraction)
    files = list_document_files(config.input_path)
    if not files:
        raise TokenizerError(f"no document files (jsonl/ndjson/parquet) under {config.input_path}")
    report["files"] = len(files)
    skipped = report.setdefault("skipped_files", [])
    per_file = max(1, config.max_bytes // len(files))
    for path in files:
        used = 0
        texts = []
        try:
            for rec in iter_documents(path, config.text_field):
                if rec.text is None:
                    continue
                texts.append(rec.text)
                used += len(rec.text)
                if used >= per_file:
                    break
        except CorruptInputError as e:
            if config.on_corrupt == "fail":
                raise
            skipped.append({"input_file": path, "reason": str(e)})
            why = corrupt_policy_violation(len(skipped), len(files), config.on_corrupt, config.max_corrupt_fraction)
            if why:
                names = "\n".join(f"  {s['reason']}" for s in skipped)
                raise TooManyCorruptFilesError(
                    f"{len(skipped)} of {len(files)} input files corrupt so far ({why}); fix or remove them, or raise "
                    f"max_corrupt_fraction:\n{names}") from None
            logger.warning("skipping corrupt file (%d so far): %s", len(skipped), e)
            continue
        report["bytes"] = report.get("bytes", 0) + used
        yield from texts


def train_bpe_tokenizer(texts, vocab_size: int, min_frequency: int = 2, eos_token: str = DEFAULT_EOS):
    """A byte-level BPE (GPT-2 style: lossless on any UTF-8 text) with ``eos_token`` as id 0."""
    # tokenizers: the data extra, only when one is trained
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[eos_token],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def train_tokenizer(config: TrainTokenizerConfig) -> None:
    """Executor step: write ``{output_path}/tokenizer.json`` and ``tokenizer_info.json``."""
    report: dict = {}
    tok = train_bpe_tokenizer(_sample_texts(config, report), config.vocab_size, config.min_frequency,
                              config.eos_token)
    learned = tok.get_vocab_size(with_added_tokens=True)
    if learned < config.vocab_size and not config.allow_small_vocab:
        merges = len(json.loads(tok.to_str())["model"]["merges"])
        raise TokenizerError(
            f"the tokenizer learned {merges} merges, {learned} of the {config.vocab_size} vocabulary entries asked: "
            f"the text under {config.input_path} ({report.get('files', 0)} file(s), {report.get('bytes', 0):,} bytes "
            f"sampled from field {config.text_field!r}) is empty or too small; give it more text, lower vocab_size or "
            "min_frequency, or pass allow_small_vocab=True (default_tokenizer, TrainTokenizerConfig) to accept a "
            "smaller vocabulary")
    text = tok.to_str()
    out = config.output_path.rstrip("/")
    fs, root = fsspec.core.url_to_fs(out)
    fs.makedirs(root, exist_ok=True)
    with fsspec.open(f"{out}/{TOKENIZER_FILE}", "w", encoding="utf-8") as f:
        f.write(text)
    info = {
        "identity": tokenizer_identity(text),
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "eos_token": config.eos_token,
        "trained_on": config.input_path,
        "files": report["files"],
        "skipped_files": report["skipped_files"],
    }
    with fsspec.open(f"{out}/tokenizer_info.json", "w") as f:
        json.dump(info, f, indent=2)
    logger.info("trained tokenizer: vocab %d, identity %s, %d files, %d corrupt files skipped", info["vocab_size"],
                info["identity"][:12], info["files"], len(info["skipped_files"]))
