"""JAX's reductions over MPI processes, inside ``jax.jit``, ``jax.vmap`` and ``jax.grad``.

    import mpiallreduce.jax as mj
    mj.psum(x, "data")            # over the "data" axis of the current mpiallreduce.Mesh
    mj.pmean(grads)               # a pytree, over every rank of COMM_WORLD
    mj.allreduce(x, op="max", comm=comm)

The names and arguments are ``jax.lax``'s (psum, pmean, pmax, pmin with ``axis_index_groups``);
docs/jax.md says what runs where. Needs JAX: ``pip install 'mpiallreduce[jax]'``.
"""

try:
    import jax  # noqa: F401
except ImportError as error:  # pragma: no cover - said in one line, as the issue asks
    raise ImportError(
        "mpiallreduce.jax needs JAX: pip install 'mpiallreduce[jax]' (or pip install 'jax[cpu]')"
    ) from error

from .collectives import allreduce, pmax, pmean, pmin, psum

__all__ = ["allreduce", "psum", "pmean", "pmax", "pmin"]
