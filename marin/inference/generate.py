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
    return generate_with_ids(run, prompts, max_new_tokens=max_new_tokens, greedy=greedy, temperature=temperature,
                             top_k=top_k, top_p=top_p, seed=seed, stop_at_eos=stop_at_eos)[0]


def generate_with_ids(run, prompts: list[str], *, max_new_tokens: int = 64, greedy: bool = False,
                      temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None, seed: int = 0,
                      stop_at_eos: bool = True) -> tuple[list[str], list[list[int]]]:
    """:func:`generate`'s continuations and the token ids they were decoded from (the end-of-text
    token that stopped one included)."""
    from marin.models.decode import generate_tokens  # JAX: load_run has set the pool's devices by now

    tok = run.require_tokenizer()
    ids = encode_prompts(tok, prompts)
    sampling = Sampling(greedy=greedy, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    stops = (tok.eos_id,) if stop_at_eos else ()
    out = generate_tokens(run.params, run.router_bias, run.cfg, ids, max_new_tokens, sampling, stop_ids=stops,
                          mesh=run.mesh)
    return decode_completions(tok, out, stop_at_eos), out


def encode_prompts(tok, prompts: list[str]) -> list[list[int]]:
    """Token ids of text ``prompts``; a one-line :class:`DecodeError` for none or an empty one."""
    if not prompts:
        raise DecodeError("no prompts given: pass at least one --prompt")
    empty = [i for i, p in enumerate(prompts) if not p]
    if empty:
        raise DecodeError(f"prompt {empty[0]} is empty: give at least one character of text")
    return tok.encode_batch(list(prompts))


def decode_completions(tok, tokens: list[list[int]], stop_at_eos: bool) -> list[str]:
    """The text of each continuation, without the end-of-text token that stopped it."""
    return [tok.decode(t[:-1] if stop_at_eos and t and t[-1] == tok.eos_id else t) for t in tokens]
