"""The scaling ladder: rung recipes from a target model (:mod:`marin.scaling.recipe`), scaling-law fits
that predict the next scale (:mod:`marin.scaling.fit`) and the fit step (:mod:`marin.scaling.ladder`).

Pure Python and numpy/scipy; nothing here imports JAX.
"""
