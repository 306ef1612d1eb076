"""Meshes (mesh.py), grouped expert compute on one device (grouped.py) and the expert-parallel (EP)
transports that move tokens to their experts (transports.py) for the MoE model."""
