"""What a decoding request may ask for, checked without JAX: sampling settings and prompts.

Kept apart from :mod:`marin.models.decode` so a command line can refuse a bad request before JAX
starts (a pool's fake CPU devices must be requested before JAX is imported) and before a model loads.
"""

from __future__ import annotations

from dataclasses import dataclass

from marin.models.config import MoEConfig


class DecodeError(ValueError):
    """A request decoding cannot serve (empty prompt, a token outside the vocabulary, too long for
    the model's context, a bad sampling setting)."""


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen. ``greedy``: the argmax (deterministic). Otherwise a draw from
    softmax(logits / temperature), restricted to the ``top_k`` most likely tokens and/or the smallest
    set whose probability reaches ``top_p`` (nucleus), from a key derived from ``seed``."""

    greedy: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0

    def __post_init__(self):
        if not self.greedy and not self.temperature > 0:
            raise DecodeError(f"temperature must be > 0 when sampling (got {self.temperature}); "
                              "use greedy decoding (--greedy) for the most likely tokens")
        if self.top_k is not None and self.top_k < 1:
            raise DecodeError(f"top_k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise DecodeError(f"top_p must be in (0, 1], got {self.top_p}")


GREEDY = Sampling(greedy=True)


def check_prompts(prompts: list[list[int]], cfg: MoEConfig, max_new_tokens: int) -> None:
    """Raise :class:`DecodeError` (one line, saying what to do) for a request decoding cannot serve."""
    if not prompts:
        raise DecodeError("no prompts given: pass at least one prompt")
    if max_new_tokens < 1:
        raise DecodeError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    for n, p in enumerate(prompts):
        if len(p) == 0:
            raise DecodeError(f"prompt {n} is empty: give at least one token of text")
        bad = [int(t) for t in p if not 0 <= int(t) < cfg.vocab_size]
        if bad:
            raise DecodeError(f"prompt {n} has token id {bad[0]} outside the vocabulary [0, {cfg.vocab_size}): "
                              "encode prompts with the run's tokenizer")
        if len(p) + max_new_tokens > cfg.max_seq_len:
            raise DecodeError(f"prompt {n} has {len(p)} tokens; with {max_new_tokens} new tokens that exceeds the "
                              f"model's context of {cfg.max_seq_len}: shorten the prompt or lower max_new_tokens")


