"""Eval sets: which documents an evaluation scores, read from token stores.

Two kinds, both token stores written by the tokenize step with the run's tokenizer:

* a **named dataset** (``EvalSet(name, store)``): every document of every source of the store is
  one set (Paloma-style suites are several of them, see ``experiments.defaults.default_eval_suite``);
* the **held-out split of a training mixture** (``mixture_validation_sets``): the trailing documents
  of every source that the mixture never trains on, one set per domain (``{name}/{domain}``), chosen
  with the mixture's own rule (:func:`marin.data.mixture.validation_documents`).

The UTF-8 byte count of a document is that of its decoded text (byte-level BPE decodes to the exact
input bytes), so bits per byte compare across tokenizers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from marin.data.k40 import split_source_name
from marin.data.mixture import validation_documents
from marin.data.store import StoreError, TokenizerMismatchError, TokenStore
from marin.data.tokenizer import LoadedTokenizer, load_tokenizer
from marin.execution.fieldcheck import check_fields
from marin.execution.versioning import input_field


class EvalSetError(ValueError):
    """An eval set that cannot be evaluated (missing, empty, or written with another tokenizer)."""


@dataclass(frozen=True)
class EvalSet:
    """One set (or, with ``held_out``, one set per domain) from a token store.

    ``held_out``: only the trailing held-out documents of each source, with the mixture's rule
    (``validation_fraction`` of them, clamped to [min, max], always leaving one for training), one set
    per domain named ``{name}/{domain}``. ``max_documents`` keeps the first documents of a set only.
    """

    name: str
    store: str = input_field()
    held_out: bool = False
    validation_fraction: float = 0.01
    validation_min_documents: int = 1
    validation_max_documents: int = 1000
    max_documents: int | None = None

    def __post_init__(self) -> None:
        check_fields(self, "EvalSet.", {"validation_fraction": "[0, 1]", "validation_min_documents": ">= 0",
                                        "validation_max_documents": ">= 0", "max_documents": ">= 1"})


@dataclass(frozen=True)
class Documents:
    """The documents of one set: token ids (no EOS) and UTF-8 bytes of each."""

    tokens: list[np.ndarray]
    bytes: np.ndarray  # int64 per document
    eos_id: int

    @property
    def num_tokens(self) -> int:
        return int(sum(t.size for t in self.tokens))


def mixture_validation_sets(mixture, name: str = "val") -> tuple[EvalSet, ...]:
    """The held-out split of a ``MixtureConfig`` as eval sets: one per domain, ``{name}/{domain}``.

    Works on a declared mixture (store paths still placeholders, values still ``versioned``) as on a
    resolved one, so experiment files and the trainer name the same sets.
    """
    return tuple(EvalSet(name=name, store=s, held_out=True, validation_fraction=mixture.validation_fraction,
                         validation_min_documents=mixture.validation_min_documents,
                         validation_max_documents=mixture.validation_max_documents)
                 for s in mixture.stores)


def _bytes_of(tokenizer_path: str, docs: list[np.ndarray]) -> np.ndarray:

    tok = load_tokenizer(tokenizer_path).tokenizer
    texts = tok.decode_batch([d.tolist() for d in docs], skip_special_tokens=False)
    return np.array([len(t.encode("utf-8")) for t in texts], dtype=np.int64)


def load_eval_set(es: EvalSet, tokenizer=None) -> dict[str, Documents]:
    """Set name -> its documents. ``tokenizer`` (path, LoadedTokenizer or identity hex): the run's
    tokenizer; a store written with another one raises :class:`EvalSetError` in one line."""

    try:
        store = TokenStore.open(es.store, tokenizer=tokenizer)
    except TokenizerMismatchError as e:
        raise EvalSetError(f"eval set {es.name!r}: tokenizer mismatch: {e}") from None
    except StoreError as e:
        raise EvalSetError(f"eval set {es.name!r}: {e}") from None
    groups: dict[str, list[np.ndarray]] = {}
    for source in store.source_names:
        reader = store.source(source)
        n = reader.num_documents
        first = 0
        if es.held_out:
            first = n - validation_documents(n, es.validation_fraction, es.validation_min_documents,
                                             es.validation_max_documents)
        set_name = f"{es.name}/{split_source_name(source)[0]}" if es.held_out else es.name
        docs = groups.setdefault(set_name, [])
        for d in range(first, n):
            if es.max_documents is not None and len(docs) >= es.max_documents:
                break
            t = reader.document(d)
            docs.append(np.asarray(t[:-1], dtype=np.int32))  # drop the closing EOS: the text's own tokens
    if not groups or not any(groups.values()):
        raise EvalSetError(
            f"eval set {es.name!r} at {es.store} has no documents"
            + (" held out (validation_fraction is 0 or every source has one document)" if es.held_out else "")
        )
    out = {}
    tok_path = store.manifest["tokenizer"]["path"]
    for set_name, docs in groups.items():
        if not docs:
            continue
        if not any(d.size for d in docs):
            raise EvalSetError(f"eval set {set_name!r} at {es.store}: every document is empty")
        out[set_name] = Documents(docs, _bytes_of(tok_path, docs), store.eos_id)
    return out


def load_eval_sets(sets, tokenizer=None) -> dict[str, Documents]:
    """All sets of a suite, by name. A domain held out in several stores of one mixture (its buckets
    tokenized apart) is one set; any other two sets with one name are an error."""
    out: dict[str, Documents] = {}
    held_out: set[str] = set()
    for es in sets:
        for name, docs in load_eval_set(es, tokenizer).items():
            if name in out:
                if not (es.held_out and name in held_out):
                    raise EvalSetError(f"two eval sets are named {name!r}; give each set its own name")
                prev = out[name]
                docs = Documents(prev.tokens + docs.tokens, np.concatenate([prev.bytes, docs.bytes]), prev.eos_id)
            out[name] = docs
            if es.held_out:
                held_out.add(name)
    return out


def run_tokenizer(data) -> str | None:
    """The tokenizer (identity hex) of a training run's data config, or None for synthetic data."""
    stores = getattr(data, "stores", None) if not isinstance(data, Mapping) else data.get("stores")
    if not stores:
        return None

    return TokenStore.open(stores[0]).tokenizer_identity


def run_tokenizer_path(data) -> str | None:
    """Where the tokenizer a training run's data config (a MixtureConfig or its record) was tokenized
    with lives, or None for synthetic data."""
    stores = getattr(data, "stores", None) if not isinstance(data, Mapping) else data.get("stores")
    if not stores:
        return None
    return TokenStore.open(stores[0]).manifest["tokenizer"]["path"]


def load_run_tokenizer(data) -> LoadedTokenizer | None:
    """The tokenizer a training run's data config was tokenized with, loaded
    (:func:`marin.data.tokenizer.load_tokenizer`), or None for synthetic data."""
    path = run_tokenizer_path(data)
    return None if path is None else load_tokenizer(path)
