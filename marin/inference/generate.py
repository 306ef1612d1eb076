"""Sampling text from a trained run: prompts in, continuations out (the tokenizer and batching
around :func:`marin.models.decode.generate_tokens`)."""

from __future__ import annotations

from marin.models.sampling import DecodeError, Sampling


def generate(run, prompts: list[str], *, max_new_tokens: int = 64, greedy: bool = False, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, seed: int = 0,
             stop_at_eos: bool = True) -> list[str]:
    """Continuations of ``prompts`` (text) from ``run`` (a :class:`marin.inference.LoadedRun`),
    batched in one KV cache whatever their lengths. ``greedy`` takes the most likely token every
    time (deterministic); otherwise tokens are drawn at ``temperature`` (with optional top-k /
    nucleus top-p), reproducibly for a given ``seed``. A continuation ends at the end-of-text token
    (not included) unless ``stop_at_eos`` is False."""
    from marin.models.decode import generate_tokens  # JAX: load_run has set the pool's devices by now

    tok = run.require_tokenizer()
    if not prompts:
        raise DecodeError("no prompts given: pass at least one --prompt")
    empty = [i for i, p in enumerate(prompts) if not p]
    if empty:
        raise DecodeError(f"prompt {empty[0]} is empty: give at least one character of text")
    sampling = Sampling(greedy=greedy, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    ids = tok.encode_batch(list(prompts))
    stops = (tok.eos_id,) if stop_at_eos else ()
    out = generate_tokens(run.params, run.router_bias, run.cfg, ids, max_new_tokens, sampling, stop_ids=stops,
                          mesh=run.mesh)
    return [tok.decode(t[:-1] if stop_at_eos and t and t[-1] == tok.eos_id else t) for t in out]
