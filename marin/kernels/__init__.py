"""Single-device compute for hot paths: the grouped expert compute of the MoE (grouped.py: SwiGLU
over capacity buffers and ragged rows, the fused one-device routed path) and the hand-written CPU
kernels it dispatches to where XLA's own lowering serves poorly (cpu.py, grouped_gemm.cc)."""
