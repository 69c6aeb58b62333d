"""The registry of allreduce algorithms: every module in this package that defines ``ALGORITHM``.

Adding an algorithm is adding a module here (see :mod:`.base`); ``ALGORITHMS`` lists their names.
"""

import importlib
import pkgutil

from ..core.plan_cases import Carries
from .base import Algorithm

__all__ = [
    "ALGORITHMS",
    "HOST_ALGORITHMS",
    "SYMMETRIC_ALGORITHMS",
    "REGISTRY",
    "check_algorithm_name",
    "Algorithm",
]

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
        _check_carries(module, algorithm)
        found[algorithm.name] = algorithm
    return found


def _check_carries(module, algorithm):
    """``carries_signature`` a Carries or None; one given by its text (``"messages"``) becomes the
    case, a misspelt one is an ImportError naming the cases (the planner compares the cases by
    identity)."""
    carries = algorithm.carries_signature
    if carries is None or isinstance(carries, Carries):
        return
    try:
        algorithm.carries_signature = Carries(carries)
    except ValueError:
        raise ImportError(
            f"{module.__name__}: carries_signature {carries!r} is none of "
            f"{', '.join(repr(c.value) for c in Carries)} (mpiallreduce.core.plan_cases.Carries)"
        ) from None


#: name -> Algorithm
REGISTRY = _discover()
#: the names accepted by ``allreduce(algorithm=...)`` besides "auto"
ALGORITHMS = tuple(REGISTRY)
#: those that run on any numpy arrays (the others are for device arrays only, or symmetric buffers)
HOST_ALGORITHMS = tuple(
    name
    for name, algorithm in REGISTRY.items()
    if algorithm.memory != "device" and not algorithm.needs_symmetric
)
#: those that run on symmetric buffers only (mpiallreduce.empty: single_copy)
SYMMETRIC_ALGORITHMS = tuple(
    name for name, algorithm in REGISTRY.items() if algorithm.needs_symmetric
)


def check_algorithm_name(algorithm, on_device):
    """Raise TypeError/ValueError unless ``algorithm`` is "auto" or a known name that suits the
    memory."""
    if not isinstance(algorithm, str):
        raise TypeError(f"algorithm must be a string, got {type(algorithm).__name__} {algorithm!r}")
    if algorithm == "auto":
        return
    chosen = REGISTRY.get(algorithm)
    if chosen is None:
        raise ValueError(
            f"unknown algorithm {algorithm!r}; expected 'auto' or one of {', '.join(ALGORITHMS)}"
        )
    if chosen.memory == "device" and not on_device:
        raise TypeError(f"algorithm {algorithm!r} runs on device (CuPy) arrays; x is a numpy array")
