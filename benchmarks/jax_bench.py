"""make bench-jax: allreduce inside ``jax.jit`` over MPI processes, mpiallreduce.jax against
the others a JAX user can pick, side by side in one run (2 ranks by default).

    contenders, each a sum over the ranks inside one jitted lax.fori_loop of K calls
    (x <- allreduce(x) / p: the values stay put, and each call needs the last one's result):
      mpiallreduce.jax   mj.psum: the XLA FFI handler (docs/jax.md)
      mpi4jax            mpi4jax.allreduce(x, op=MPI.SUM) (make mpi4jax builds it; left out
                         where it is not installed)
      pure_callback      jax.pure_callback around mpi4py's comm.Allreduce (a host round trip
                         through Python each call)
      jax_gloo           JAX's own: jax.distributed.initialize with the gloo CPU collectives,
                         lax.psum under jax.shard_map over the processes' devices
      mpi4py             at the smallest size only: comm.Allreduce itself in a Python loop (the
                         per-call price every wrapper is measured against)

    a time   per call: the fori_loop's time / K, the slowest rank's (MPI_MAX), after a barrier
    a row    per size and contender: the median of R repetitions, interleaved (each repetition
             runs every contender once, in an order rotated each time); ratio = theirs / ours

Written to OUTPUT/jax.json (every repetition, the machine's load, versions) and OUTPUT/table.md
(python benchmarks/jax_bench.py --table OUTPUT writes the table again from the JSON). Every
contender's result is checked against the mean of every rank's input (numpy's): a wrong one is
counted, and said.
"""

import argparse
import datetime
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

SIZES = (4, 64 << 10, 1 << 20, 16 << 20)
CONTENDERS = ("mpiallreduce.jax", "mpi4jax", "pure_callback", "jax_gloo", "mpi4py")


def calls_for(nbytes):
    """K, the calls in one timed fori_loop: about 128 MiB moved, 8 to 8192 calls (tens of ms: a
    spike of the machine's load is a small part of one)."""
    return max(8, min(8192, (128 << 20) // max(nbytes, 16 << 10)))


def start_jax(world):
    """jax.distributed with the gloo CPU collectives (rank 0 the coordinator, on a free loopback
    port), before JAX's backend starts; (jax, whether gloo runs)."""
    import jax

    port = None
    if world.Get_rank() == 0:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
    port = world.bcast(port)
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{port}",
            num_processes=world.Get_size(),
            process_id=world.Get_rank(),
            local_device_ids=[0],
        )
        gloo = True
    except Exception as error:  # noqa: BLE001 - said, and the contender left out
        print(f"[rank {world.Get_rank()}] jax_gloo left out: {error}", file=sys.stderr)
        gloo = False
    return jax, bool(world.allreduce(int(gloo), op=MPI.MIN))


def contenders(jax, world, gloo, nbytes, calls, algorithms=()):
    """{name: (run(x) -> result, the input x)} for this size; ``algorithms``: the handler's, each
    named as a contender of its own too ("mpiallreduce.jax:ring")."""
    import jax.numpy as jnp
    from jax import lax

    import mpiallreduce.jax as mj

    size, rank = world.Get_size(), world.Get_rank()
    n = max(1, nbytes // 4)
    local = jax.local_devices()[0]
    x = jax.device_put(jnp.asarray((np.arange(n) % 97 + rank * 3).astype(np.float32)), local)
    inverse = np.float32(1.0 / size)

    def looped(one_call):
        return jax.jit(lambda v: lax.fori_loop(0, calls, lambda i, a: one_call(a) * inverse, v))

    made = {"mpiallreduce.jax": (looped(mj.psum), x)}
    for name in algorithms:
        made[f"mpiallreduce.jax:{name}"] = (
            looped(lambda a, name=name: mj.allreduce(a, algorithm=name)),
            x,
        )
    try:
        import mpi4jax

        comm = world.Dup()
        made["mpi4jax"] = (looped(lambda a: mpi4jax.allreduce(a, op=MPI.SUM, comm=comm)), x)
    except ImportError:
        pass
    callback_comm = world.Dup()

    def host_allreduce(a):
        out = np.empty_like(np.asarray(a))
        callback_comm.Allreduce(np.asarray(a), out, op=MPI.SUM)
        return out

    shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
    made["pure_callback"] = (
        looped(lambda a: jax.pure_callback(host_allreduce, shape, a)),
        x,
    )
    if gloo:
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        mesh = jax.make_mesh((size,), ("p",), devices=jax.devices())
        summed = jax.shard_map(
            lambda a: lax.psum(a, "p"), mesh=mesh, in_specs=P("p"), out_specs=P("p")
        )
        whole = jax.make_array_from_process_local_data(NamedSharding(mesh, P("p")), np.asarray(x))
        made["jax_gloo"] = (looped(summed), whole)
    if nbytes == SIZES[0]:
        raw_comm = world.Dup()
        buffer = np.asarray(x).copy()

        def raw(_):
            for _ in range(calls):
                raw_comm.Allreduce(MPI.IN_PLACE, buffer, op=MPI.SUM)
                np.multiply(buffer, inverse, out=buffer)
            return buffer

        made["mpi4py"] = (raw, x)
    return made


def ready(result):
    block = getattr(result, "block_until_ready", None)
    return block() if block else result


def local_part(result):
    shards = getattr(result, "addressable_shards", None)
    return np.asarray(shards[0].data if shards else result)


def _named(made):
    return [n for n in CONTENDERS if n in made] + sorted(n for n in made if n not in CONTENDERS)


def measure(world, sizes, repetitions, algorithms=()):
    jax, gloo = start_jax(world)
    size, rank = world.Get_size(), world.Get_rank()
    rows, wrong = [], []
    for nbytes in sizes:
        calls = calls_for(nbytes)
        made = contenders(jax, world, gloo, nbytes, calls, algorithms)
        names = _named(made)
        n = max(1, nbytes // 4)
        want = np.mean(
            [(np.arange(n) % 97 + r * 3).astype(np.float32) for r in range(size)], axis=0
        )
        for name in names:  # (compiled and checked once, untimed)
            run, x = made[name]
            got = local_part(ready(run(x)))
            if not np.allclose(got, want, rtol=1e-4):
                wrong.append((nbytes, name))
        times = {name: [] for name in names}
        for repetition in range(repetitions):
            order = names[repetition % len(names) :] + names[: repetition % len(names)]
            for name in order:
                run, x = made[name]
                world.Barrier()
                began = time.perf_counter()
                ready(run(x))
                took = (time.perf_counter() - began) / calls
                times[name].append(world.allreduce(took, op=MPI.MAX))
        for name in names:
            rows.append(
                {
                    "bytes": nbytes,
                    "contender": name,
                    "calls_per_loop": calls,
                    "median_us": float(np.median(times[name]) * 1e6),
                    "times_us": [t * 1e6 for t in times[name]],
                }
            )
        if rank == 0:
            print(
                f"{nbytes:>10} B: "
                + ", ".join(
                    f"{r['contender']} {r['median_us']:.1f} us" for r in rows[-len(names) :]
                ),
                flush=True,
            )
    return rows, wrong, gloo


def _version(module):
    try:
        return __import__(module).__version__
    except ImportError:
        return None


def write_table(folder):
    """OUTPUT/table.md from OUTPUT/jax.json: per size, each contender's median and its ratio to
    mpiallreduce.jax's (theirs / ours: above 1, ours is faster)."""
    document = json.loads((Path(folder) / "jax.json").read_text())
    rows = document["rows"]
    names = _named({r["contender"] for r in rows})
    others = [c for c in names if c != "mpiallreduce.jax"]
    lines = [
        f"{document['ranks']} ranks, `{document['command']}`, {document['date']}, commit "
        f"{document['commit']}, load before {document['load_before']}, after "
        f"{document['load_after']}; median of {document['repetitions']} interleaved "
        "repetitions, per call; ratio = theirs / mpiallreduce.jax's (above 1: ours is faster); "
        f"wrong results: {len(document['wrong'])}.",
        "",
        "| bytes | mpiallreduce.jax (us) | "
        + " | ".join(f"{c} (us) | ratio" for c in others)
        + " |",
        "| ---: | ---: | " + " | ".join("---: | ---:" for _ in others) + " |",
    ]
    for nbytes in sorted({r["bytes"] for r in rows}):
        at = {r["contender"]: r["median_us"] for r in rows if r["bytes"] == nbytes}
        ours = at["mpiallreduce.jax"]
        cells = []
        for c in others:
            cells += [f"{at[c]:.1f}", f"{at[c] / ours:.2f}x"] if c in at else ["", ""]
        lines.append(f"| {nbytes} | {ours:.1f} | " + " | ".join(cells) + " |")
    (Path(folder) / "table.md").write_text("\n".join(lines) + "\n")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", default="results/bench-jax")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)))
    parser.add_argument("--repetitions", type=int, default=15)
    parser.add_argument("--table", metavar="FOLDER", help="only write FOLDER/table.md again")
    parser.add_argument(
        "--algorithms",
        default="",
        help="the handler's algorithms to time as contenders of their own too (comma-separated)",
    )
    args = parser.parse_args()
    if args.table:
        print(write_table(args.table))
        return
    world = MPI.COMM_WORLD
    load_before = os.getloadavg()
    rows, wrong, gloo = measure(
        world,
        [int(s) for s in args.sizes.split(",")],
        args.repetitions,
        [a for a in args.algorithms.split(",") if a],
    )
    if world.Get_rank() == 0:
        commit = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        import jax

        document = {
            "command": "make bench-jax",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": commit,
            "host": socket.gethostname(),
            "ranks": world.Get_size(),
            "cores": os.cpu_count(),
            "load_before": [round(v, 2) for v in load_before],
            "load_after": [round(v, 2) for v in os.getloadavg()],
            "repetitions": args.repetitions,
            "versions": {
                "jax": jax.__version__,
                "mpi4jax": _version("mpi4jax"),
                "mpi4py": _version("mpi4py"),
                "mpi": MPI.Get_library_version().split("\n")[0],
            },
            "jax_gloo": gloo,
            "wrong": wrong,
            "rows": rows,
        }
        folder = Path(args.output)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "jax.json").write_text(json.dumps(document, indent=1) + "\n")
        print(write_table(folder))
    if wrong:
        sys.exit(f"wrong results: {wrong}")


if __name__ == "__main__":
    main()
