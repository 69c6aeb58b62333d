"""The registry of allreduce algorithms: every module in this package that defines ``ALGORITHM``.

Adding an algorithm is adding a module here (see :mod:`.base`); ``ALGORITHMS`` lists their names.
"""
import importlib
import pkgutil

from .base import Algorithm

__all__ = ["ALGORITHMS", "HOST_ALGORITHMS", "REGISTRY", "get_algorithm", "Algorithm"]

_NOT_ALGORITHM_MODULES = {"base", "power_of_two"}


def _discover():
    found = {}
    for module_info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if module_info.name in _NOT_ALGORITHM_MODULES:
            continue
        module = importlib.import_module(f"{__name__}.{module_info.name}")
        algorithm = getattr(module, "ALGORITHM", None)
        if not isinstance(algorithm, Algorithm):
            raise ImportError(f"{module.__name__} defines no ALGORITHM (an Algorithm instance)")
        if algorithm.name in found:
            raise ImportError(f"two algorithms are named {algorithm.name!r}")
        found[algorithm.name] = algorithm
    return found


#: name -> Algorithm
REGISTRY = _discover()
#: the names accepted by ``allreduce(algorithm=...)`` besides "auto"
ALGORITHMS = tuple(REGISTRY)
#: those that run on numpy arrays (the others are for device arrays only)
HOST_ALGORITHMS = tuple(name for name, algorithm in REGISTRY.items() if algorithm.memory != "device")


def get_algorithm(name):
    """The algorithm called ``name`` (not "auto"); ValueError naming the choices otherwise."""
    if not isinstance(name, str):
        raise TypeError(f"algorithm must be a string, got {type(name).__name__} {name!r}")
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown algorithm {name!r}; expected 'auto' or one of {', '.join(ALGORITHMS)}"
        ) from None
