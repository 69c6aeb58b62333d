"""mpiallreduce: allreduce for numpy arrays over MPI, MPI_Allreduce and hand-written algorithms side
by side.

    import mpiallreduce as mar
    total = mar.allreduce(x)                       # sum over all ranks of COMM_WORLD
    mar.allreduce(g, op="mean", out=g)             # in place
    mar.allreduce(x, algorithm="ring", comm=sub)   # a chosen algorithm on a sub-communicator

Names are loaded on first use, so that ``import mpiallreduce`` (the ``mpiallreduce launch`` command
among others) does not start MPI by itself; the first use of the API does, or, in a rank of a
launched job, the import where MPIALLREDUCE_ABORT_ON_EXCEPTION=1 (``mpiallreduce launch`` sets it):
an exception before the first call then aborts the job too (mpiallreduce.faults.aborting).
"""

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Callable, Sequence
from types import CodeType, ModuleType
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "allreduce": ".api",
    "prepare": ".api",
    "PreparedAllreduce": ".api",
    "describe_call": ".api",
    "psum": ".api",
    "pmean": ".api",
    "pmax": ".api",
    "pmin": ".api",
    "allreduce_async": ".api",
    "empty": ".api",
    "zeros": ".api",
    "GradientSync": ".training.gradients",
    "broadcast_parameters": ".training.gradients",
    "check_replicas": ".training.gradients",
    "Mesh": ".core.mesh",
    "ALGORITHMS": ".algorithms",
    "SYMMETRIC_ALGORITHMS": ".algorithms",
    "HOST_ALGORITHMS": ".algorithms",
    "select_gpu": ".core.node_rank",
    "OPS": ".core.ops",
    "AllreduceTimeout": ".faults",
    "RankFailure": ".faults",
    "AllreduceStallWarning": ".faults",
    "AllreduceAborted": ".faults",
    "SignatureMismatch": ".core.consistency",
    "SettingsMismatch": ".core.state",
    "survivors": ".faults",
    "exit_after_rank_failures": ".faults",
    "abort_on_exception": ".faults.aborting",
    "dump_trace": ".faults.recorder",
}

#: where the modules of the flat layout went (docs/architecture.md): their old import paths still
#: work, as the same module objects (``import mpiallreduce.torch``, ``mpiallreduce.gradients``...)
MOVED = {
    "aborting": "faults.aborting",
    "agreement": "core.consistency",
    "arguments": "tools.arguments",
    "asynchronous": "core.worker",
    "bench": "tools.bench",
    "buckets": "training.buckets",
    "buffers": "core.buffers",
    "cli": "tools.cli",
    "comms": "core.comms",
    "compression": "training.compression",
    "gradients": "training.gradients",
    "info": "tools.info",
    "launch": "tools.launch",
    "mesh": "core.mesh",
    "model": "tools.model",
    "mpilib": "core.mpilib",
    "openmpi_tuned": "tools.openmpi_tuned",
    "ops": "core.ops",
    "planner": "core.planner",
    "plot": "tools.plot",
    "reproducible_kernels": "reproducible.kernels",
    "results": "tools.results",
    "scaling": "tools.report",
    "settings": "core.settings",
    "startup": "core.startup",
    "state": "core.state",
    "topology": "core.topology",
    "torch": "training.torch",
    "train_bench": "tools.train_bench",
    "transports": "device.transports",
    "tune": "tools.tune",
    "tuning": "core.tuning",
}


class _Alias(importlib.abc.Loader):
    """Loads an old module path as the module that now lives elsewhere (the same object)."""

    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self.target)

    def exec_module(self, module: ModuleType) -> None:
        pass

    def get_code(self, name: str) -> CodeType:
        """``python -m`` with an old path: code that runs the moved module as ``__main__`` under its
        own name (its relative imports resolve in its own package)."""
        return compile(
            f"import runpy\nrunpy.run_module({self.target!r}, run_name='__main__', "
            "alter_sys=True)\n",
            f"<{name}: {self.target}>",
            "exec",
        )


class _MovedModules(importlib.abc.MetaPathFinder):
    def find_spec(
        self,
        name: str,
        path: Sequence[str] | None = None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        prefix = __name__ + "."
        if not name.startswith(prefix):
            return None
        old = name[len(prefix) :]
        for before, after in MOVED.items():
            if old == before or old.startswith(before + "."):
                return importlib.util.spec_from_loader(
                    name, _Alias(prefix + after + old[len(before) :])
                )
        return None


sys.meta_path.insert(0, _MovedModules())

__all__ = list(_EXPORTS) + ["__version__"]


#: the package's own plumbing, not for users (dir() leaves them out)
_PLUMBING = {"lazy_exports", "MOVED", "abort_on_exception_from_environment"}


def _public(package: str, name: str, value: object) -> bool:
    if name.startswith("_") and name != "__version__" or name in _PLUMBING:
        return False
    return not isinstance(value, ModuleType) or value.__name__.startswith(package + ".")


def lazy_exports(
    package: str, exports: dict[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A module ``__getattr__`` for ``package`` that imports each name of ``exports`` (name -> the
    module it lives in, relative to ``package``) at its first use, and keeps it."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name], package), name)
        setattr(sys.modules[package], name, value)
        return value

    # (what a user reaches: no helper, nor a module it imported for itself)
    def __dir__() -> list[str]:
        module = sys.modules[package]
        return sorted(set(exports) | {n for n, v in vars(module).items() if _public(package, n, v)})

    return __getattr__, __dir__


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:  # what a type checker reads of the names above (_EXPORTS): the same objects
    from .algorithms import ALGORITHMS as ALGORITHMS
    from .algorithms import HOST_ALGORITHMS as HOST_ALGORITHMS
    from .algorithms import SYMMETRIC_ALGORITHMS as SYMMETRIC_ALGORITHMS
    from .api import PreparedAllreduce as PreparedAllreduce
    from .api import allreduce as allreduce
    from .api import allreduce_async as allreduce_async
    from .api import describe_call as describe_call
    from .api import empty as empty
    from .api import pmax as pmax
    from .api import pmean as pmean
    from .api import pmin as pmin
    from .api import prepare as prepare
    from .api import psum as psum
    from .api import zeros as zeros
    from .core.consistency import SignatureMismatch as SignatureMismatch
    from .core.mesh import Mesh as Mesh
    from .core.node_rank import select_gpu as select_gpu
    from .core.ops import OPS as OPS
    from .core.state import SettingsMismatch as SettingsMismatch
    from .faults.aborting import abort_on_exception as abort_on_exception
    from .faults.errors import AllreduceAborted as AllreduceAborted
    from .faults.errors import AllreduceStallWarning as AllreduceStallWarning
    from .faults.errors import AllreduceTimeout as AllreduceTimeout
    from .faults.errors import RankFailure as RankFailure
    from .faults.recorder import dump_trace as dump_trace
    from .faults.ulfm import exit_after_rank_failures as exit_after_rank_failures
    from .faults.ulfm import survivors as survivors
    from .training.gradients import GradientSync as GradientSync
    from .training.gradients import broadcast_parameters as broadcast_parameters
    from .training.gradients import check_replicas as check_replicas

from .faults.aborting import abort_on_exception_from_environment  # noqa: E402 (no MPI at import)

abort_on_exception_from_environment()
