# What a type checker reads of the compiled hot paths (_compiled.c; mpiallreduce.core.compiled
# says what each does): the names it defines, their arguments as its PyArg_ParseTuple formats take
# them (positional only).
from typing import Any

#: the most dimensions a short path's arrays may have
MAX_DIMENSIONS: int

class PreparedBase:
    """A prepared call whose runs on a persistent request are compiled (Prepared's base)."""

    def _bind_compiled(self, *bound: Any) -> None: ...
    def _compiled_bound(self) -> bool: ...
    def __call__(self) -> Any: ...

class ShortPath:
    """The short path of a repeated plain call (compiled.short_path)."""

    def __init__(self, *bound: Any) -> None: ...
    def run(self, x: Any, out: Any, /) -> Any: ...

def exchange_rounds(*arguments: Any) -> Any: ...
