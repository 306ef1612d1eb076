"""Sampling from a run's model on a pool of several hosts: one JAX process per host, started by the
pool launcher (:func:`marin.pools.launch`, the one training uses).

The command line (the driver) reads the prompts, checks them and turns them into token ids with the
run's tokenizer; every host restores only its own slices of the checkpoint (the sharded restore,
:func:`marin.training.checkpoint.load_model` on the pool's mesh) and runs the same decoding program,
which spans the pool's devices; process 0 hands the continuations back and the driver prints them.
No process, the driver included, ever holds the whole model: what a host holds is what its devices
hold (the expert weights split over the mesh's expert axis, the rest replicated), so a pool whose
devices can hold the model can sample from it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from marin.evaluation.sets import load_run_tokenizer
from marin.inference.evaluate import every_process_agrees
from marin.inference.generate import decode_completions, encode_prompts
from marin.inference.run import RunLoadError, committed_run_steps, load_verified_checkpoint
from marin.models.sampling import Sampling, check_prompts
from marin.pools import HostContext, PoolSpec, as_pool, run_on_pool
from marin.training.checkpoint import load_model, model_config_of
from marin.training.run import Run


@dataclass(frozen=True)
class SampleRequest:
    """What every host of the pool decodes: token id prompts (already checked) and how to choose."""

    prompts: tuple[tuple[int, ...], ...]
    max_new_tokens: int
    sampling: Sampling
    stop_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class PoolSamples:
    """Process 0's answer: the checkpoint step decoded and the new token ids of each prompt."""

    step: int
    tokens: list[list[int]]


def sample_on_host(ctx: HostContext, run_dir: str, step: int | None, request: SampleRequest) -> PoolSamples | None:
    """Host function (every process of the pool runs it): restore this host's slices of the
    checkpoint onto the pool's mesh and decode ``request``; process 0 returns the result, the
    others None (every process computed the same tokens, so one copy is enough)."""
    # JAX only on the pool's hosts: the driver reads and checks the prompts without it
    from marin.models.decode import generate_tokens
    from marin.parallel.mesh import make_mesh  # JAX (see above)

    mesh = make_mesh(*ctx.pool.mesh)
    step, model = load_verified_checkpoint(run_dir, step, lambda s: load_model(run_dir, mesh, step=s),
                                           agree=every_process_agrees(ctx))
    tokens = generate_tokens(model.params, model.router_bias, model.config, [list(p) for p in request.prompts],
                             request.max_new_tokens, request.sampling, stop_ids=request.stop_ids, mesh=mesh)
    return PoolSamples(step, tokens) if ctx.process_id == 0 else None


def run_pool(run_dir: str, step: int | None, pool: str | PoolSpec | None) -> PoolSpec:
    """The pool a command uses ``run_dir``'s model on: ``pool`` if given, else the one the run
    trained on (one device for a run that recorded none). One-line errors for an unknown pool and
    for a directory without committed checkpoints."""
    if pool is None:
        steps = committed_run_steps(run_dir)
        pool = Run(run_dir).record(step if step in steps else steps[-1]).get("pool") or "local-cpu-1"
    try:
        return as_pool(pool)  # a command line's name, or the spec the run's record holds
    except KeyError as e:
        raise ValueError(e.args[0]) from None


def sample_text_on_pool(run_dir: str, step: int | None, pool: PoolSpec, prompts: list[str], *,
                        max_new_tokens: int, sampling: Sampling, stop_at_eos: bool = True,
                        address: str | None = None,
                        say: Callable[[str], None] | None = None) -> tuple[int, list[str], list[list[int]]]:
    """``(step, continuations, their token ids)`` of text ``prompts`` decoded on every host of
    ``pool``, on the Ray cluster at ``address`` or on simulated nodes
    (:func:`marin.pools.run_on_pool`). The prompts are refused here, before any host
    starts, in the same one line as on one host."""
    steps = committed_run_steps(run_dir)
    if step is not None and step not in steps:
        raise RunLoadError(f"{run_dir} has no committed checkpoint at step {step}; committed: {steps}")
    run, at = Run(run_dir), steps[-1] if step is None else step
    record = run.record(at)
    tok = load_run_tokenizer(run.config(at).data)
    if tok is None:
        raise ValueError(f"{run_dir} was trained on synthetic tokens (no tokenizer): it cannot read or write text; "
                         "pass token ids instead")
    ids = encode_prompts(tok, prompts)
    check_prompts(ids, model_config_of({"config": record}), max_new_tokens)
    stops = (tok.eos_id,) if stop_at_eos else ()
    request = SampleRequest(tuple(tuple(p) for p in ids), max_new_tokens, sampling, stops)
    result = run_on_pool(pool, sample_on_host, (run_dir, step, request), address=address, say=say)
    return result.step, decode_completions(tok, result.tokens, stop_at_eos), result.tokens
