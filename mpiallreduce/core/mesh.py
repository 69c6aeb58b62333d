"""Named-axis reductions over a process mesh, and reductions within groups of ranks.

``Mesh((2, 3), ("data", "model"))`` lays the ranks of a communicator out row-major on a named grid
(``MPI_Cart_create`` without reordering, so rank r sits at the row-major coordinates of r):

    ranks            data = 0:  0 1 2        "data" axis: {0, 3} {1, 4} {2, 5}
    coords (d, m)    data = 1:  3 4 5        "model" axis: {0, 1, 2} {3, 4, 5}

``mesh.comm("model")`` is the communicator of the ranks that differ only in their "model"
coordinate (``MPI_Cart_sub``), made once and cached; ``allreduce(x, axis="model")`` reduces over
it. ``groups=[[0, 1], [2, 3, 4]]`` reduces within each group of ranks (of the axis, or of the
communicator): a ``Split`` by group, cached. ``psum``/``pmean``/``pmax``/``pmin`` read as JAX's.
"""

import contextvars
import math
from collections.abc import Iterable, Sequence
from typing import Literal, cast

from mpi4py import MPI

from .comms import cached

__all__ = ["Mesh", "current_mesh", "resolve_communicator", "group_communicator"]

#: an axis, or several (their product): names of a mesh's axes
Axis = str | Sequence[str]

_current: contextvars.ContextVar["Mesh | None"] = contextvars.ContextVar(
    "mpiallreduce_mesh", default=None
)


def current_mesh() -> "Mesh | None":
    """The mesh made current by ``with mesh:``, or None."""
    return _current.get()


class Mesh:
    """The ranks of ``comm`` on a named grid of ``shape``; collective to make."""

    def __init__(
        self, shape: Iterable[int], axis_names: Iterable[str], comm: MPI.Intracomm | None = None
    ) -> None:
        comm = MPI.COMM_WORLD if comm is None else comm
        shape = tuple(shape)
        axis_names = tuple(axis_names)
        if len(shape) != len(axis_names):
            raise ValueError(
                f"mesh shape {shape} has {len(shape)} axes but {len(axis_names)} names {axis_names}"
            )
        if not all(isinstance(n, str) for n in axis_names) or len(set(axis_names)) != len(
            axis_names
        ):
            raise ValueError(f"axis names must be distinct strings, got {axis_names}")
        if not all(isinstance(d, int) and d >= 1 for d in shape):
            raise ValueError(f"mesh shape must be positive integers, got {shape}")
        if math.prod(shape) != comm.Get_size():
            raise ValueError(
                f"mesh shape {shape} holds {math.prod(shape)} ranks but the communicator "
                f"has {comm.Get_size()}"
            )
        self.shape = shape
        self.axis_names = axis_names
        self.cart = comm.Create_cart(dims=list(shape), periods=[False] * len(shape), reorder=False)
        self.coords = tuple(self.cart.Get_coords(self.cart.Get_rank()))
        self._subs: dict[frozenset[int], MPI.Cartcomm] = {}
        self._token: list[contextvars.Token[Mesh | None]] = []

    def axis_index(self, name: str) -> int:
        try:
            return self.axis_names.index(name)
        except ValueError:
            raise ValueError(
                f"unknown mesh axis {name!r}; this mesh has {self.axis_names}"
            ) from None

    def size(self, axis: Axis) -> int:
        """How many ranks lie along ``axis`` (a name, or a tuple of names: the product)."""
        return math.prod(self.shape[self.axis_index(a)] for a in _names(axis))

    def comm(self, axis: Axis) -> MPI.Cartcomm:
        """The communicator along ``axis`` (a name or a tuple of names); cached."""
        indices = frozenset(self.axis_index(a) for a in _names(axis))
        if indices not in self._subs:
            self._subs[indices] = self.cart.Sub([i in indices for i in range(len(self.shape))])
        return self._subs[indices]

    def __enter__(self) -> "Mesh":
        self._token.append(_current.set(self))
        return self

    def __exit__(self, *exc: object) -> Literal[False]:
        _current.reset(self._token.pop())
        return False

    def free(self) -> None:
        for sub in self._subs.values():
            sub.Free()
        self._subs.clear()
        self.cart.Free()

    def __repr__(self) -> str:
        return f"Mesh(shape={self.shape}, axis_names={self.axis_names}, coords={self.coords})"


def _names(axis: Axis) -> tuple[str, ...]:
    names = (axis,) if isinstance(axis, str) else tuple(axis)
    if not names:
        raise ValueError("axis must name at least one mesh axis")
    return names


def check_groups(groups: Iterable[Iterable[int]], size: int) -> tuple[tuple[int, ...], ...]:
    """The groups as a tuple of tuples, if they partition range(size); ValueError otherwise."""
    try:
        checked = tuple(tuple(int(r) for r in g) for g in groups)
    except TypeError:
        raise ValueError(f"groups must be a list of lists of ranks, got {groups!r}") from None
    seen: dict[int, int] = {}  # (a rank -> its group)
    for index, group in enumerate(checked):
        if not group:
            raise ValueError(f"group {index} is empty")
        for r in group:
            if not 0 <= r < size:
                raise ValueError(f"group {index} names rank {r}, but the ranks are 0..{size - 1}")
            if r in seen:
                raise ValueError(
                    f"rank {r} is in group {seen[r]} and in group {index}; groups must not overlap"
                )
            seen[r] = index
    missing = [r for r in range(size) if r not in seen]
    if missing:
        raise ValueError(f"ranks {missing} are in no group; groups must cover all {size} ranks")
    return checked


def group_communicator(comm: MPI.Intracomm, groups: Sequence[Sequence[int]]) -> MPI.Intracomm:
    """This rank's group of ``comm`` (groups already checked), ranks in group order; cached."""

    def make() -> MPI.Intracomm:
        rank = comm.Get_rank()
        for index, group in enumerate(groups):
            if rank in group:
                # (an Intracomm's Split is one: mpi4py's stubs say Comm)
                return cast(MPI.Intracomm, comm.Split(color=index, key=group.index(rank)))
        raise AssertionError("unreachable: checked groups cover every rank")

    return cached(comm, ("groups", groups), make)


def resolve_communicator(
    comm: MPI.Intracomm | None,
    axis: Axis | None,
    mesh: "Mesh | None",
    groups: Iterable[Iterable[int]] | None,
) -> MPI.Intracomm:
    """The communicator an allreduce with these arguments reduces over (collective on first use)."""
    if axis is not None:
        if comm is not None:
            raise ValueError("give comm or axis (with a mesh), not both")
        mesh = mesh if mesh is not None else current_mesh()
        if mesh is None:
            raise ValueError(f"axis={axis!r} needs a mesh: pass mesh=... or use `with mesh:`")
        comm = mesh.comm(axis)
    elif mesh is not None and comm is None:
        comm = mesh.cart
    comm = MPI.COMM_WORLD if comm is None else comm
    if groups is not None:
        comm = group_communicator(comm, check_groups(groups, comm.Get_size()))
    return comm
