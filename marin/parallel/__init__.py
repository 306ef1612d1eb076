"""Meshes (mesh.py), the EP buffer capacities (capacity.py, JAX-free) and the expert-parallel (EP)
transports that move tokens to their experts (transports.py) for the MoE model. The single-device
expert compute they call is :mod:`marin.kernels.grouped`."""
