"""Run under ``mpiallreduce launch --nodes N``: every host algorithm and auto across emulated nodes.

Prints one line per rank and algorithm: ``rank R node H ALGORITHM ok`` when the result equals
numpy's on the gathered inputs and has the same bits on every rank, else what went wrong; algorithms
that need one node must refuse on every rank (``refused``). Sizes straddle the signature threshold.
Then ``rank R node H reproducible-sums ...``: reproducible sums through auto (the direct route,
pairwise_exchange) and three algorithms of the words route, one set of bits everywhere and
numpy's sum (the inputs sum exactly). Then ``rank R node H device-auto ...``: device arrays (the
CuPy stand-in, mpiallreduce.testing.fake_cupy) through auto, which across nodes must not take
device_to_device. Then ``rank R node H mismatched-calls ...``: calls that differ in size below 64
KiB (100 against 101 elements), for every algorithm that runs across nodes and auto (and for auto
sizes whose dissemination messages have tails, against others), are the same ValueError on every
rank (the signature compared in messages across nodes), and the next call is right. Then ``rank R
node H timed-on-one-rank ...``: a call timed on rank 0 only ends with an error on every rank, and
the next calls are right (nothing of it is left to pair with them). Then ``rank R node H
refused-on-one-rank ...``: an algorithm the planner refuses across nodes, asked for on rank 0 only,
is an error on every rank (rank 0 takes part in the comparison), and the next call is right. Then
``rank R node H symmetric-arrays ...``: symmetric arrays (mpiallreduce.empty) across nodes are
reduced right by the ordinary paths, never single_copy, which is refused by name.
"""

import hashlib
import sys

from mpi4py import MPI

sys.path.insert(0, __file__.rsplit("/scripts/", 1)[0] + "/mpi")
from reference import exact_input, gather_inputs, numpy_reference, values_equal  # noqa: E402

import mpiallreduce as mar  # noqa: E402
from mpiallreduce.algorithms import REGISTRY  # noqa: E402
from mpiallreduce.reproducible.routes import EXACT_OPS  # noqa: E402

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
node = MPI.Get_processor_name()
for name in list(mar.HOST_ALGORITHMS) + ["auto"]:
    outcome = "ok"
    for count in (1, comm.Get_size() + 1, 1009, 7677, (1 << 16) + 3, (1 << 20) + 3):
        x = exact_input("float64", count, rank, "sum")
        want = numpy_reference("sum", gather_inputs(comm, x))
        try:
            got = mar.allreduce(x, algorithm=name)
        except ValueError as error:
            refusals = (
                "needs every rank of the communicator on one node",
                "needs the same number of ranks on every node",
            )
            outcome = "refused" if any(r in str(error) for r in refusals) else f"raised {error}"
            break
        digests = comm.allgather(hashlib.sha256(got.tobytes()).hexdigest())
        if not values_equal(got, want) or len(set(digests)) != 1:
            outcome = f"wrong at count {count}"
            break
    needs = (
        ""
        if name == "auto"
        else (
            " (needs one node)"
            if REGISTRY[name].needs_one_node
            else " (needs equal nodes)"
            if REGISTRY[name].needs_equal_nodes
            else ""
        )
    )
    print(f"rank {rank} node {node} {name} {outcome}{needs}", flush=True)

# reproducible sums: the direct route (auto: pairwise_exchange across nodes), the words route
outcome = "ok"
for count in (1009, (1 << 16) + 3):
    x = exact_input("float32", count, rank, "sum")
    want = numpy_reference("sum", gather_inputs(comm, x))
    results = {
        name: mar.allreduce(x, algorithm=name, reproducible=True)
        for name in ("auto", "ring", "hierarchical", "mpi")
    }
    digests = comm.allgather(
        sorted({hashlib.sha256(got.tobytes()).hexdigest() for got in results.values()})
    )
    if (
        not all(values_equal(got, want) for got in results.values())
        or len({tuple(d) for d in digests}) != 1
        or len(digests[0]) != 1
    ):
        outcome = f"wrong at count {count}: {len(digests[0])} sets of bits here"
        break
    if "pairwise_exchange" not in mar.describe_call(x, op=EXACT_OPS["sum"]):
        outcome = f"auto planned {mar.describe_call(x, op=EXACT_OPS['sum'])}"
        break
print(f"rank {rank} node {node} reproducible-sums {outcome}", flush=True)

import mpiallreduce.testing.fake_cupy as fake_cupy  # noqa: E402

outcome = "ok"
for count in (1, 1009, (1 << 16) + 3, (1 << 20) + 3):
    x = exact_input("float32", count, rank, "sum")
    want = numpy_reference("sum", gather_inputs(comm, x))
    try:
        plan = mar.describe_call(fake_cupy.asarray(x))
        got = fake_cupy.asnumpy(mar.allreduce(fake_cupy.asarray(x)))
    except Exception as error:  # (every rank prints what it got)
        outcome = f"raised {type(error).__name__}: {error}"
        break
    digests = comm.allgather(hashlib.sha256(got.tobytes()).hexdigest())
    if not values_equal(got, want) or len(set(digests)) != 1:
        outcome = f"wrong at count {count}"
        break
    if "device_to_device" in str(plan):
        outcome = f"planned device_to_device across nodes: {plan}"
        break
print(f"rank {rank} node {node} device-auto {outcome}", flush=True)

outcome = (
    "ok"  # calls that differ in size: a ValueError on every rank, never values (auto: dissemination
)
# carrying the check on both, then against MPI's own; on 2 ranks with tails past one head, of other
# lengths or against none, one way and the other)
for name, mine, other in [
    ("auto", 100, 101),
    ("auto", 100, 5000),
    ("auto", 100, 15001),
    ("auto", 15001, 100),
    ("auto", 15000, 13000),
    ("auto", 7677, 7676),
] + [
    (a, 100, 101)
    for a in mar.HOST_ALGORITHMS
    if not REGISTRY[a].needs_one_node and not REGISTRY[a].needs_equal_nodes
]:
    try:
        mar.allreduce(
            exact_input("float64", mine if rank == 0 else other, rank, "sum"), algorithm=name
        )
        outcome = f"{name}: no error"
    except ValueError as error:
        if "shape differs" not in str(error):
            outcome = f"{name}: {error}"
    x = exact_input("float64", 100, rank, "sum")
    if not values_equal(
        mar.allreduce(x, algorithm=name), numpy_reference("sum", gather_inputs(comm, x))
    ):
        outcome = f"{name}: wrong after the mismatch"
    if outcome != "ok":
        break
print(f"rank {rank} node {node} mismatched-calls {outcome}", flush=True)

outcome = (
    "ok"  # a call timed on one rank only: an error on every rank, and the communicator goes on
)
try:
    mar.allreduce(exact_input("float64", 100, rank, "sum"), timeout=2 if rank == 0 else None)
    outcome = "no error"
except (mar.AllreduceTimeout, mar.AllreduceAborted):
    pass
x = exact_input("float64", (1 << 15) + 1, rank, "sum")
if not values_equal(
    mar.allreduce(x, algorithm="ring", timeout=30), numpy_reference("sum", gather_inputs(comm, x))
):
    outcome = "wrong after the call timed on one rank"
print(f"rank {rank} node {node} timed-on-one-rank {outcome}", flush=True)

# refused by the planner on rank 0 only: an error on every rank, and the next call is right
outcome = "ok"
try:
    mar.allreduce(
        exact_input("float64", 100, rank, "sum"), algorithm="shared_memory" if rank == 0 else "ring"
    )
    outcome = "no error"
except ValueError as error:
    if rank != 0 and "rejected on rank 0" not in str(error):
        outcome = f"{error}"
x = exact_input("float64", 100, rank, "sum")
if not values_equal(mar.allreduce(x), numpy_reference("sum", gather_inputs(comm, x))):
    outcome = "wrong after the refused call"
print(f"rank {rank} node {node} refused-on-one-rank {outcome}", flush=True)

outcome = (
    "ok"  # symmetric arrays across nodes: ordinary arrays there (no single copy), right values
)
count = (1 << 16) + 3
x, out = mar.empty(count, "float64"), mar.empty(count, "float64")
x[...] = exact_input("float64", count, rank, "sum")
want = numpy_reference("sum", gather_inputs(comm, x.copy()))
prepared = mar.prepare(x, out=out)
if not values_equal(mar.allreduce(x, out=out), want) or not values_equal(prepared(), want):
    outcome = "wrong"
elif "single_copy" in repr(prepared):
    outcome = f"planned {prepared!r}"
try:
    mar.allreduce(x, out=out, algorithm="single_copy")
    outcome = "single_copy by name not refused"
except ValueError as error:
    if "symmetric buffers only" not in str(error):
        outcome = f"{error}"
print(f"rank {rank} node {node} symmetric-arrays {outcome}", flush=True)
