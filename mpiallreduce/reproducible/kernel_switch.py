"""MPIALLREDUCE_REPRODUCIBLE_KERNELS: whether the reproducible sum's float32 conversions may run
compiled (numba's, reproducible.kernels, where installed) or must run as numpy's passes
(reproducible.exact), for comparisons. Read by the kernels' module as it is imported, and named by
``mpiallreduce info``."""

__all__ = ["KERNELS_ENV"]

#: "numpy" forces the numpy passes (for comparisons); anything else uses numba where installed
#: (mpiallreduce.reproducible_kernels)
KERNELS_ENV = "MPIALLREDUCE_REPRODUCIBLE_KERNELS"
