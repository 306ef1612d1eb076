"""The ``marin`` subcommands, one module each (see :mod:`marin.cli` for how to add one).

Each module holds a command's arguments (``add_arguments(parser)``) and what it does with them
(``run(args) -> int``, the exit status); the work itself lives in the library package the command
is about (:mod:`marin.review`, :mod:`marin.training.planning`, :mod:`marin.evaluation`, ...).
"""
