"""The ``mpiallreduce`` command: ``info``, ``bench``, ``plot``, ``tune``, ``report``, ``model``,
``trace`` and ``launch``."""

import os
import signal
import sys
from pathlib import Path

from .arguments import ArgumentParser, unknown

USAGE = """mpiallreduce COMMAND [ARGS]

commands:
  info      MPI library and version, ranks, how they were launched, CUDA-awareness
            (run it under mpiexec/srun to see every rank)
  bench     every algorithm against Open MPI's default MPI_Allreduce (run under mpiexec/srun)
  plot      PNG figures of a bench run: mpiallreduce plot RESULTS_DIR
  tune      measure every algorithm here, write the table "auto" reads (run under mpiexec/srun)
  report    merge bench runs (several layouts, a job array's) into one table and a scaling plot:
            mpiallreduce report RESULTS_DIR... [--output DIR]
  model     fit latency/bandwidth within and between nodes and reduce costs to bench runs,
            project every algorithm to many ranks: mpiallreduce model RESULTS_DIR...
  trace     merge the flight recorder's dumps (one per rank) and say which rank and which call
            parted from the others: mpiallreduce trace DIR
  launch    start a command on N ranks with this machine's mpiexec flags:
            mpiallreduce launch -n 4 [--timeout SECONDS] [--nodes N] -- python script.py
"""


def _info(argv):
    parser = ArgumentParser(
        prog="mpiallreduce info",
        description="the MPI library and its version, the ranks and their nodes, how they were "
        "launched, CUDA-awareness and the GPUs: run it under the launcher to see every rank",
        examples=("mpiallreduce info", "mpiallreduce launch -n 2 -- mpiallreduce info"),
    )
    parser.add_argument(
        "--device",
        choices=["gpu", "fake-gpu"],
        metavar="{gpu}",  # (fake-gpu: the tests' stand-in, not for users)
        default="gpu",
        help="the GPU part: real CuPy (default), or the stand-in "
        "(tests, the device check's dry run)",
    )
    args = parser.parse_args(argv)
    from mpi4py import MPI

    from .info import collect, format_report

    info = collect(MPI.COMM_WORLD, device=args.device)
    if info is not None:
        print(format_report(info), flush=True)
    return 0


def _bench(argv):
    from .bench import main

    return main(argv)


def _launch(argv):
    parser = ArgumentParser(
        prog="mpiallreduce launch",
        usage="mpiallreduce launch [-h] [-n RANKS] [--timeout SECONDS] [--grace SECONDS] "
        "[--fault-tolerant] [--nodes N] [--mpi-notices] -- command [args ...]",
        description="Start a command on N ranks: srun --mpi=pmix inside a Slurm allocation, else "
        "mpiexec with this machine's flags (MPIALLREDUCE_LAUNCHER=srun|mpiexec to choose).",
        examples=(
            "mpiallreduce launch -n 2 -- python first.py",
            "mpiallreduce launch -n 4 --nodes 2 --timeout 600 -- python train.py",
            "mpiallreduce launch -n 3 --fault-tolerant -- python -m mpiallreduce.train",
        ),
    )
    parser.add_argument(
        "-n",
        "--ranks",
        type=int,
        default=None,
        help="rank count (default inside Slurm: the allocation's task count)",
    )
    parser.add_argument(
        "--timeout", type=float, default=None, help="kill everything after this many seconds"
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="after SIGTERM, SIGINT (Ctrl-C) or SIGHUP, which reach every rank as SIGTERM, how "
        "long the ranks get to checkpoint and end before they are killed (default 30); the "
        "launcher exits with their status (99 after a checkpoint: jobs/train.sbatch requeues on "
        "it)",
    )
    parser.add_argument(
        "--fault-tolerant",
        action="store_true",
        help="ULFM (mpiexec --with-ft ulfm): ranks survive the death of others",
    )
    parser.add_argument(
        "--nodes",
        type=int,
        default=None,
        metavar="N",
        help="spread the ranks over N nodes. Inside a Slurm allocation: N of its nodes (srun -N). "
        "Elsewhere: N emulated nodes of this machine (node0, node1, ...; ranks by block), each "
        "node's daemon in a UTS namespace of its own, so Open MPI sees N nodes, shared memory "
        "within them and TCP between them. Needs root. Not a cluster: one machine's cores and "
        "memory bandwidth, the kernel's loopback for a network",
    )
    parser.add_argument(
        "--mpi-notices",
        action="store_true",
        help="show every notice of Open MPI's, also the abort notices that follow a rank's own "
        "explanation (an uncaught exception, sys.exit(n)) and the setpgid warnings of --nodes",
    )
    parser.add_argument("command", nargs="...", metavar="-- command", help="what each rank runs")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command to launch")
    if args.ranks is not None and args.ranks < 1:
        parser.error(f"-n {args.ranks}: give at least 1 rank")
    if args.nodes is not None and not 1 <= args.nodes <= (args.ranks or args.nodes):
        parser.error(f"--nodes {args.nodes}: give between 1 and the rank count")
    if args.timeout is not None and not args.timeout > 0:
        parser.error(f"--timeout {args.timeout}: give a positive number of seconds")
    if not args.grace >= 0:
        parser.error(f"--grace {args.grace}: give a number of seconds, 0 or more")
    from ..faults.aborting import ABORT_ENV
    from .fault_tolerant import fault_tolerant_flags
    from .launch import launch_command, launch_environment, run

    # One rank's uncaught exception (with its traceback) or sys.exit(n), n nonzero, ends the job
    # with status 1 or n (in programs that import mpiallreduce; faults/aborting.py), rather than
    # leaving the others waiting for it, unless the caller set MPIALLREDUCE_ABORT_ON_EXCEPTION=0.
    env = launch_environment(dict(os.environ, **{ABORT_ENV: os.environ.get(ABORT_ENV, "1")}))
    argv = launch_command(args.ranks, command, fault_tolerant=args.fault_tolerant, nodes=args.nodes)
    if Path(argv[0]).name == "srun":  # (srun passes signals on to its tasks itself: become it)
        if args.timeout is not None:
            parser.error("--timeout is for mpiexec; under Slurm give srun or sbatch --time")
        os.execvpe(argv[0], argv, env)
    # mpiexec: stay its parent, so that TERM, INT and HUP reach the ranks as SIGTERM, with --grace
    # seconds to checkpoint (mpiallreduce.tools.ranks), and the ranks' exit status is the launcher's
    nranks = args.ranks if args.ranks is not None else int(argv[argv.index("-n") + 1])
    cores = len(os.sched_getaffinity(0))
    if nranks > cores:  # (issue 58: it ran silently; the ranks then take turns on the cores)
        print(
            f"mpiallreduce launch: {nranks} ranks on {cores} cores: they take turns on them "
            "(oversubscribed), so timings measure the scheduler more than the ranks",
            file=sys.stderr,
        )
    result = run(
        nranks,
        command,
        timeout=args.timeout,
        capture=False,
        env=env,
        forward_signals=True,
        extra_flags=fault_tolerant_flags() if args.fault_tolerant else (),
        nodes=args.nodes,
        grace=args.grace,
        mpi_notices=args.mpi_notices,
    )
    if result.timed_out:
        print(f"mpiallreduce launch: {result.killed}", file=sys.stderr)
        return 124 if "timeout" in result.killed else 128 + signal.SIGTERM
    return (
        128 - result.returncode if result.returncode < 0 else result.returncode
    )  # (a signal: as a shell says it)


def _plot(argv):
    from .plot import main

    return main(argv)


def _tune(argv):
    from .tune import main

    return main(argv)


def _report(argv):
    from .report import main

    return main(argv)


def _model(argv):
    from .model import main

    return main(argv)


def _trace(argv):
    from .trace import main

    return main(argv)


COMMANDS = {
    "info": _info,
    "bench": _bench,
    "plot": _plot,
    "tune": _tune,
    "report": _report,
    "model": _model,
    "launch": _launch,
    "trace": _trace,
}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if not argv or argv[0] not in COMMANDS:
        print(USAGE, file=sys.stderr)
        if argv:
            print("mpiallreduce: " + unknown("command", argv[0], list(COMMANDS)), file=sys.stderr)
        return 2
    try:
        return COMMANDS[argv[0]](argv[1:])
    except BrokenPipeError:  # (`... | head`: the reader left; no traceback for that)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
