"""Meshes and expert-parallel (EP) transports for the MoE model."""
