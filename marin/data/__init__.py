"""marin.data: Harrier K40 layout, synthetic miniature, dedup and decontamination, tokenizers, token store,
tokenize step, mixtures.

The pieces, in pipeline order (each step function takes one frozen config dataclass):

* :mod:`marin.data.k40` - the 40 domains x 5 quality buckets and the directory convention.
* :mod:`marin.data.synthetic` - ``generate_k40_miniature``: a deterministic K40-shaped corpus.
* :mod:`marin.data.corpus_steps` - ``CorpusInput`` and the frame of every per-file corpus step (planning,
  restart markers, the Ray fan-out, the corrupt-input policy, the checks, the kept records).
* :mod:`marin.data.dedup` - ``dedup``: exact and MinHash-LSH near-duplicates removed, same layout out.
* :mod:`marin.data.decontaminate` - ``decontaminate``: documents sharing an n-gram with an eval set removed.
* :mod:`marin.data.tokenizer` - ``train_tokenizer`` (byte-level BPE) and ``load_tokenizer``.
* :mod:`marin.data.tokenize` - ``tokenize``: documents -> token store, fanned out on Ray.
* :mod:`marin.data.store` - ``TokenStore``: uint32 shards + document boundaries + manifest.
* :mod:`marin.data.mixture` - ``MixtureConfig`` / ``MixtureLoader``: stateless training batches.

Nothing here imports JAX; ``tokenizers`` and ``pyarrow`` are imported only when used.
"""

from marin.data.corpus_steps import CorpusInput, CorpusStepError
from marin.data.k40 import K40_DOMAINS, QUALITY_BUCKETS, K40Layout
from marin.data.loader import MixtureLoader
from marin.data.mixture import MixtureConfig, MixtureError, MixtureStage
from marin.data.store import StoreError, TokenizerMismatchError, TokenStore
from marin.data.tokenize import TokenizeConfig, TokenizeError, tokenize
from marin.data.tokenizer import TrainTokenizerConfig, load_tokenizer, train_tokenizer

__all__ = [
    "CorpusInput",
    "CorpusStepError",
    "K40_DOMAINS",
    "QUALITY_BUCKETS",
    "K40Layout",
    "MixtureConfig",
    "MixtureError",
    "MixtureLoader",
    "MixtureStage",
    "StoreError",
    "TokenStore",
    "TokenizeConfig",
    "TokenizeError",
    "TokenizerMismatchError",
    "TrainTokenizerConfig",
    "load_tokenizer",
    "tokenize",
    "train_tokenizer",
]
