"""Hand-written kernels for hot paths that XLA's own lowering serves poorly (see cpu.py)."""
