"""The MoE transformer: config and accounting (config.py, JAX-free), router (router.py), model
(transformer.py) and the plain definition of its routed experts that the fast paths are tested
against (reference.py)."""
from marin.models.config import PRESETS, MoEConfig, count_params, flops_per_token, get_preset
from marin.models.exported import load_exported

__all__ = ["MoEConfig", "PRESETS", "get_preset", "count_params", "flops_per_token", "load_exported"]
