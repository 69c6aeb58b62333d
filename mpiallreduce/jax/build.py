"""``python -m mpiallreduce.jax.build``: build mpiallreduce.jax's XLA handler ahead (handler.py)
and print where it lies; make test runs it once per environment."""

from .handler import built_library

if __name__ == "__main__":
    print(built_library())
