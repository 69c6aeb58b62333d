"""Named-axis and grouped reductions over a process mesh, against numpy on the gathered inputs."""

import hashlib
import itertools
import math

import numpy as np
import pytest
from mpi4py import MPI
from reference import (
    exact_input,
    gather_inputs,
    numpy_reference,
    op_applies,
    problems_with,
    values_equal,
)

import mpiallreduce as mar

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD
OPS = ["sum", "prod", "min", "max", "mean"]


def mesh_shapes(p):
    """1-D, every 2-D and every 3-D factorisation of p into ordered factors (3-D capped at 6)."""
    divisors = [d for d in range(1, p + 1) if p % d == 0]
    two = [(a, p // a) for a in divisors]
    three = sorted({(a, b, p // a // b) for a in divisors for b in divisors if (p // a) % b == 0})[
        :6
    ]
    return [(p,)] + two + three


def axis_choices(names):
    return [c for k in range(1, len(names) + 1) for c in itertools.combinations(names, k)]


def expected_along(gathered, shape, axis_indices, op):
    """numpy's answer for this rank: reduce over the ranks that share its coordinates off the
    axes."""
    mine = np.unravel_index(WORLD.Get_rank(), shape)
    members = [
        r
        for r in range(WORLD.Get_size())
        if all(
            np.unravel_index(r, shape)[i] == mine[i]
            for i in range(len(shape))
            if i not in axis_indices
        )
    ]
    return numpy_reference(op, gathered[members]), members


@pytest.mark.parametrize("algorithm", list(mar.HOST_ALGORITHMS) + ["auto"])
def test_every_axis_of_every_mesh(algorithm):
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    problems = []
    for shape in mesh_shapes(size):
        names = tuple("abc"[: len(shape)])
        mesh = mar.Mesh(shape, names)
        assert mesh.coords == tuple(int(c) for c in np.unravel_index(rank, shape)), (
            "row-major layout"
        )
        for axes in axis_choices(names):
            indices = [names.index(a) for a in axes]
            assert mesh.size(axes) == math.prod(shape[i] for i in indices)
            for op in OPS:
                for dtype in ["float64", "int32"]:
                    if not op_applies(op, dtype):
                        continue
                    for count in (1, size + 1, 1009):
                        x = exact_input(dtype, count, rank, op)
                        expected, members = expected_along(
                            gather_inputs(WORLD, x), shape, indices, op
                        )
                        axis = axes[0] if len(axes) == 1 else axes
                        result = mar.allreduce(x, op=op, algorithm=algorithm, mesh=mesh, axis=axis)
                        case = (
                            f"mesh {shape} axis {axes} {op} {dtype} count={count} (group {members})"
                        )
                        problems += problems_with(mesh.comm(axis), result, expected, case)
        mesh.free()
    assert not problems, f"rank {rank}:\n" + "\n".join(problems[:20])


def partitions(size):
    """Equal and unequal ways to cut range(size) into groups (each a partition)."""
    ranks = list(range(size))
    found = [[ranks], [[r] for r in ranks]]
    if size >= 2:
        found.append([ranks[:1], ranks[1:]])  # 1 + (size - 1): unequal
        found.append([ranks[::2], ranks[1::2]])  # interleaved
    if size >= 5:
        found.append(
            [[4, 0], [1, 2, 3]] + ([ranks[5:]] if size > 5 else [])
        )  # unequal, out of order
    return found


@pytest.mark.parametrize("algorithm", ["mpi", "ring", "recursive_doubling", "auto"])
def test_groups_of_the_communicator(algorithm):
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    problems = []
    for groups in partitions(size):
        mine = next(g for g in groups if rank in g)
        for op in OPS:
            x = exact_input("float64", 101, rank, op)
            gathered = gather_inputs(WORLD, x)
            expected = numpy_reference(op, gathered[sorted(mine)])
            result = mar.allreduce(x, op=op, algorithm=algorithm, groups=groups)
            if not values_equal(result, expected):
                problems.append(f"groups {groups} {op}: got {result[:3]}, expected {expected[:3]}")
            digests = WORLD.allgather(hashlib.sha256(result.tobytes()).hexdigest())
            if len({digests[r] for r in mine}) != 1:
                problems.append(
                    f"groups {groups} {op}: members of group {mine} hold different bits"
                )
    assert not problems, f"rank {rank}:\n" + "\n".join(problems)


def test_pmean_with_unequal_groups_divides_by_the_own_group_size():
    """JAX 0.10.2 divides every group by the first group's size; here each group uses its own."""
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    groups = [[0], list(range(1, size))] if size > 1 else [[0]]
    mine = next(g for g in groups if rank in g)
    x = np.full(3, float(rank + 1))
    expected = np.full(3, sum(r + 1 for r in mine) / len(mine))
    assert values_equal(mar.pmean(x, axis_index_groups=groups), expected)


def test_jax_style_aliases_on_a_mesh():
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    shape = (2, size // 2) if size % 2 == 0 else (1, size)
    with mar.Mesh(shape, ("data", "model")) as mesh:
        x = exact_input("float64", 17, rank, "sum")
        gathered = gather_inputs(WORLD, x)
        for function, op in [
            (mar.psum, "sum"),
            (mar.pmean, "mean"),
            (mar.pmax, "max"),
            (mar.pmin, "min"),
        ]:
            for axis, indices in [("data", [0]), ("model", [1]), (("data", "model"), [0, 1])]:
                expected, _ = expected_along(gathered, shape, indices, op)
                assert values_equal(function(x, axis), expected), (function.__name__, axis)
            assert values_equal(function(x), numpy_reference(op, gathered)), (
                "axis_name=None: all of COMM_WORLD"
            )
        # groups within an axis: the "model" axis cut into its first rank and the rest
        model_size = mesh.size("model")
        groups = [[0], list(range(1, model_size))] if model_size > 1 else [[0]]
        my_index = mesh.coords[1]
        members = [
            r
            for r in range(size)
            if np.unravel_index(r, shape)[0] == mesh.coords[0]
            and any(my_index in g and np.unravel_index(r, shape)[1] in g for g in groups)
        ]
        assert values_equal(
            mar.psum(x, "model", axis_index_groups=groups),
            numpy_reference("sum", gathered[members]),
        )
        mesh.free()


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(groups=[[0]] if WORLD.Get_size() > 1 else [[]]), r"in no group|is empty"),
        (dict(groups=[list(range(WORLD.Get_size())), [0]]), r"rank 0 is in group 0 and in group 1"),
        (dict(groups=[list(range(WORLD.Get_size() + 1))]), r"names rank \d+, but the ranks are"),
        (dict(groups=[[]] + [list(range(WORLD.Get_size()))]), r"group 0 is empty"),
        (dict(axis="data"), r"needs a mesh"),
        (dict(axis="data", comm=WORLD), r"give comm or axis"),
    ],
)
def test_bad_groups_and_axes_raise_on_every_rank(bad, message):
    with pytest.raises(ValueError, match=message):
        mar.allreduce(np.ones(3), **bad)
    assert mar.allreduce(np.ones(3))[0] == WORLD.Get_size()  # and the next call works


def test_bad_meshes_raise_on_every_rank():
    size = WORLD.Get_size()
    with pytest.raises(
        ValueError, match=rf"holds {size + 1} ranks but the communicator has {size}"
    ):
        mar.Mesh((size + 1,), ("data",))
    with pytest.raises(ValueError, match="has 2 axes but 1 names"):
        mar.Mesh((1, size), ("data",))
    with pytest.raises(ValueError, match="distinct strings"):
        mar.Mesh((1, size), ("data", "data"))
    mesh = mar.Mesh((size,), ("data",))
    with pytest.raises(ValueError, match="unknown mesh axis 'model'"):
        mar.allreduce(np.ones(3), mesh=mesh, axis="model")
    assert mar.allreduce(np.ones(3), mesh=mesh, axis="data")[0] == size
    mesh.free()
