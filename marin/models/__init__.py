"""The MoE transformer: config and accounting (config.py, JAX-free), router (router.py), model
(transformer.py), the plain definition of its routed experts that the fast paths are tested
against (reference.py), KV-cache decoding (decode.py, sampling.py), the exported-weights format
(exported.py: ``load_exported``) and the numpy-only reference forward (numpy_forward.py)."""
from marin.models.config import PRESETS, MoEConfig, count_params, flops_per_token, get_preset
from marin.models.exported import load_exported

__all__ = ["MoEConfig", "PRESETS", "get_preset", "count_params", "flops_per_token", "load_exported"]
