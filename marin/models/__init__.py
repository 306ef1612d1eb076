"""The MoE transformer: config and accounting (config.py, JAX-free), router (router.py), model (transformer.py)."""
from marin.models.config import PRESETS, MoEConfig, count_params, flops_per_token, get_preset

__all__ = ["MoEConfig", "PRESETS", "get_preset", "count_params", "flops_per_token"]
