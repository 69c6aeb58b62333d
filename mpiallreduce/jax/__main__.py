"""``python -m mpiallreduce.jax``: the XLA handler's path, built first where there is none
(mpiallreduce/jax/handler.py)."""

from .handler import built_library

print(built_library())
