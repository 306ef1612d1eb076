"""The whole train step (forward, backward, AdamW, router-bias update) lowers for CUDA at the
production mesh shapes from this CPU-only machine, for every EP transport, with no host callback and
no CPU-only custom call on the GPU path."""

import re

import jax
import pytest

from marin.jaxcompat import compute_platform, lowering_for
from marin.kernels import cpu as kernels
from marin.models.config import get_preset
from marin.training.config import ParallelismConfig, SyntheticDataConfig, TelemetryConfig, TrainConfig
from marin.training.lowering import custom_call_targets, forbidden_ops, lower_eval_forward, lower_train_step
from marin.training.trainer import model_config

# d2048 and the hero with 2 layers (one local, one global: both attention kinds); a small batch that
# still splits over every device of the mesh. Lowering cost does not grow with the layer count (scan).
MESHES = {"11 racks": (11, 64), "1 rack": (1, 64)}


def _config(model: str, seq_len: int = 256, **kw) -> TrainConfig:
    """The preset ``model`` with 2 layers, one sequence-length phase (a batch of 64 whole sequences
    unless ``tokens_per_step`` is given: a batch always holds whole sequences)."""
    kw.setdefault("tokens_per_step", 64 * seq_len)
    return TrainConfig(output_path="", data=SyntheticDataConfig(), model=get_preset(model, n_layers=2),
                       seq_len_phases=((0.0, seq_len),), telemetry=TelemetryConfig(wandb_project=None), **kw)


def _lower(model, mesh_shape, transport, seq_len=256, platform="cuda"):
    # XLA's grouped GEMM by name: "auto" picks capacity buffers when the GPU's cuDNN is unknown
    config = _config(model, seq_len, parallelism=ParallelismConfig(grouped_impl="ragged_dot"))
    devices = mesh_shape[0] * mesh_shape[1]
    return lower_train_step(config, model_config(config), mesh_shape, transport, batch_size=devices,
                            seq_len=seq_len, platform=platform).as_text()


@pytest.mark.parametrize("transport", ["fixed", "dropless", "ragged"])
@pytest.mark.parametrize("mesh", sorted(MESHES))
@pytest.mark.parametrize("model", ["d2048", "hero"])
def test_train_step_lowers_for_cuda(model, mesh, transport):
    text = _lower(model, MESHES[mesh], transport)
    assert forbidden_ops(text) == []
    assert "stablehlo.all_to_all" in text or "ragged_all_to_all" in text  # EP really happens
    targets = custom_call_targets(text)
    if transport == "ragged":
        # the real collective, not the CPU emulation
        assert "ragged_all_to_all" in targets
    else:
        assert "ragged_all_to_all" not in targets
    if transport in ("dropless", "ragged"):
        assert "chlo.ragged_dot" in text  # the GPU grouped GEMM, not the CPU capacity buffers
    # the optimizer update is in the same program (AdamW second moment: a square root)
    assert "stablehlo.sqrt" in text and "stablehlo.dot_general" in text


@pytest.mark.parametrize("model,mesh", [("hero", "11 racks"), ("d2048", "1 rack")])
def test_ragged_capacity_train_step_lowers_for_cuda(model, mesh):
    """The capacity-bounded ragged transport at the production mesh shapes: the real
    ragged_all_to_all (one call per chunk there and back), the grouped GEMM, nothing CPU-only."""
    text = _lower(model, MESHES[mesh], "ragged_capacity")
    assert forbidden_ops(text) == []
    assert "ragged_all_to_all" in custom_call_targets(text)
    assert "chlo.ragged_dot" in text
    assert "stablehlo.sqrt" in text and "stablehlo.dot_general" in text


@pytest.mark.parametrize("model,mesh,transport", [("hero", "11 racks", "fixed"), ("d2048", "1 rack", "dropless")])
def test_fsdp_train_step_lowers_for_cuda(model, mesh, transport):
    """The fsdp layout (weights and AdamW state split over the mesh) at the production shapes: the
    state arrives sharded beyond the expert axis, and the program is still GPU-clean."""
    config = _config(model, parallelism=ParallelismConfig(param_sharding="fsdp"))
    shape = MESHES[mesh]
    lowered = lower_train_step(config, model_config(config), shape, transport, batch_size=shape[0] * shape[1],
                               seq_len=256)
    text = lowered.as_text()
    assert forbidden_ops(text) == []
    assert "stablehlo.all_to_all" in text
    # wq, wo and their two AdamW moments ([layers, d, d]) enter split on a non-layer dimension
    d = model_config(config).d_model
    specs = re.findall(rf"tensor<2x{d}x{d}xf32> {{sdy.sharding = #sdy.sharding<@mesh, (\[.*?\])>", text)
    assert len(specs) >= 6 and all(spec.startswith("[{}, {") and '"expert"' in spec for spec in specs), specs
    if model == "hero":
        # its routed experts, stored padded to 3080 = 11 x 280, enter split over the 11 racks too
        f = model_config(config).stored_expert_width
        specs = re.findall(rf"tensor<2x384x3072x{f}xf32> {{sdy.sharding = #sdy.sharding<@mesh, (\[.*?\])>", text)
        assert len(specs) >= 6 and all(spec == '[{}, {"expert"}, {}, {"data"}]' for spec in specs), specs


def test_lowering_for_restores_the_platform():
    before = compute_platform()
    with lowering_for("cuda"):
        assert compute_platform() == "gpu"
    assert compute_platform() == before == jax.default_backend()


@pytest.mark.skipif(not kernels.available(), reason="CPU kernel not buildable here (no compiler or BLAS wheel)")
def test_check_catches_cpu_kernels_on_a_cpu_lowering():
    """The same check flags the CPU program: the fixed transport's f32 experts call marin's CPU
    kernels there, which must never appear on the GPU path."""
    text = _lower("tiny-ep", (2, 4), "fixed", seq_len=32, platform="cpu")
    assert any(t.startswith("marin_") for t in forbidden_ops(text)), custom_call_targets(text)
    assert not any(t.startswith("marin_") for t in forbidden_ops(_lower("tiny-ep", (2, 4), "fixed", 32)))


@pytest.mark.parametrize("transport", ["fixed", "dropless", "ragged"])
def test_accumulating_train_step_lowers_for_cuda(transport):
    """Gradient accumulation (the planner picks microbatches > 1 on GPU pools) on the one-rack mesh."""
    config = _config("d2048")
    text = lower_train_step(config, model_config(config), (1, 64), transport, batch_size=4 * 64, seq_len=256,
                            microbatches=4).as_text()
    assert forbidden_ops(text) == []
    assert text.count("stablehlo.while") >= 2  # the microbatch scan around the layer scan


@pytest.mark.parametrize("mesh", sorted(MESHES))
@pytest.mark.parametrize("model", ["d2048", "hero"])
def test_eval_forward_lowers_for_cuda(model, mesh):
    """The evaluator's forward (dropless experts on an EP mesh, per-token NLL) is GPU-clean too."""
    config = _config(model)
    shape = MESHES[mesh]
    text = lower_eval_forward(config, model_config(config), shape, batch_size=shape[0] * shape[1],
                              seq_len=256).as_text()
    assert forbidden_ops(text) == []
    assert "stablehlo.all_to_all" in text or "ragged_all_to_all" in text


@pytest.mark.parametrize("lower", ["train", "eval"])
def test_blocked_attention_lowers_for_cuda(lower):
    """The hero's blocked attention (and its custom backward) at the 262K phase in the CUDA train step
    and the evaluator's forward: loops over key blocks, no [L, L] scores, nothing on the host."""
    seq_len = 262_144
    config = _config("hero", seq_len)
    cfg = model_config(config)
    block = cfg.attention_block
    assert cfg.attention_impl == "blocked" and seq_len % block == 0 and block < seq_len
    if lower == "train":
        text = lower_train_step(config, cfg, (1, 64), "fixed", batch_size=64, seq_len=seq_len).as_text()
    else:
        text = lower_eval_forward(config, cfg, (1, 64), batch_size=64, seq_len=seq_len).as_text()
    assert forbidden_ops(text) == []
    assert f"{seq_len}x{seq_len}x" not in text  # no score matrix over the whole sequence
    assert f"{block}x{block}x" in text  # the tiles
    assert text.count("stablehlo.while") >= 3  # layer scan, query blocks, key blocks (x2 with the backward)


def test_the_hero_state_is_created_sharded_on_the_gpus():
    """The hero's sharded init lowers for CUDA on the (11, 64) mesh with every leaf's output sharded
    as training places it (routed experts over expert x data, dense weights 64 ways): each GPU
    computes only its shards of the 6.4 TB state; nothing is built on a host."""
    from marin.training.lowering import abstract_mesh
    from marin.training.trainer import fresh_state, model_config, state_shapes, state_shardings

    config = TrainConfig(output_path="", data=SyntheticDataConfig(), model="hero", pool="gb200-11racks",
                         tokens_per_step=11264 * 4096, seq_len_phases=((0.0, 4096),),
                         parallelism=ParallelismConfig(param_sharding="fsdp"),
                         telemetry=TelemetryConfig(wandb_project=None))
    cfg = model_config(config)
    mesh = abstract_mesh(11, 64)
    with lowering_for("cuda"):
        shapes = state_shapes(config, cfg)
        shardings = state_shardings(shapes, mesh, "fsdp")
        text = jax.jit(lambda: fresh_state(config, cfg), out_shardings=shardings).trace().lower(
            lowering_platforms=("cuda",)).as_text()
    main = next(line for line in text.splitlines() if "func.func public @main" in line)
    results = main.split("->", 1)[1]
    assert results.count("jax.result_info") == len(jax.tree.leaves(shapes))
    assert ('tensor<48x384x3072x3080xf32> {jax.result_info = "result[\'params\'][\'blocks\'][\'expert_gate\']", '
            'sdy.sharding = #sdy.sharding<@mesh, [{}, {"expert"}, {}, {"data"}]>}') in results
    assert "callback" not in text
