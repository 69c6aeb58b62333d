"""``mpiallreduce info``: what MPI this is, how it was launched, and where every rank runs."""

import os
import socket

import mpi4py
import numpy as np
from mpi4py import MPI

from .. import __version__
from ..algorithms import ALGORITHMS, REGISTRY
from ..core.mpilib import cuda_aware, library_version, loaded_libmpi
from ..core.settings import settings
from ..device.arrays import CUDA_AWARE_ENV
from ..device.arrays import cuda_aware as cuda_aware_decision
from ..device.transports import device_path
from .gpu_info import format_gpu, gpu_facts

__all__ = ["launch_method", "slurm_variables", "collect", "format_report"]

SLURM_VARIABLES = (
    "SLURM_JOB_ID",
    "SLURM_JOB_NAME",
    "SLURM_JOB_NODELIST",
    "SLURM_NNODES",
    "SLURM_NTASKS",
    "SLURM_NTASKS_PER_NODE",
    "SLURM_STEP_ID",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NODEID",
    "SLURM_CPUS_PER_TASK",
    "SLURM_MPI_TYPE",
    "SLURM_ARRAY_TASK_ID",
    "SLURM_RESTART_COUNT",
)


def launch_method(environ=None, world_size=None):
    """How this process was started: 'mpiexec (Open MPI)', 'mpiexec (MPICH hydra)', 'srun' or
    'singleton'."""
    env = os.environ if environ is None else environ
    if "OMPI_COMM_WORLD_SIZE" in env or "PRTE_LAUNCHED" in env:
        return "mpiexec (Open MPI)"
    if "HYDI_CONTROL_FD" in env or "MPI_LOCALNRANKS" in env:
        return "mpiexec (MPICH hydra)"
    if "SLURM_STEP_ID" in env and ("PMIX_RANK" in env or "PMI_RANK" in env or "PMI_FD" in env):
        return "srun"
    return "singleton (not started by mpiexec or srun)"


def slurm_variables(environ=None):
    env = os.environ if environ is None else environ
    return {key: env[key] for key in SLURM_VARIABLES if key in env}


def _node_local_rank(comm):
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_rank(), node.Get_size()
    finally:
        node.Free()


def gpu_choice(local_rank, environ=None):
    """The GPU ``mpiallreduce.select_gpu`` gives this rank, as (index among the visible GPUs, the
    device it is), without making any GPU current; None where no GPU is visible or known of.

    The visible GPUs are CuPy's count where CuPy sees any, else the entries of CUDA_VISIBLE_DEVICES
    (what Slurm's --gpus-per-task / --gpu-bind set), so a job's binding can be checked anywhere.
    """
    from ..device.arrays import gpu_for_local_rank

    env = os.environ if environ is None else environ
    visible = env.get("CUDA_VISIBLE_DEVICES")
    devices = [d.strip() for d in visible.split(",") if d.strip()] if visible is not None else None
    count = None
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount() or None
    except Exception:  # no CuPy, no driver, no device
        pass
    if count is None and devices:
        count = len(devices)
    if not count:
        return None
    index = gpu_for_local_rank(local_rank, count)
    return index, devices[index] if devices and index < len(devices) else str(index)


def collect(comm=MPI.COMM_WORLD, device="gpu"):
    """Everything ``info`` reports; collective over ``comm``, complete on rank 0 (None elsewhere).
    ``device``: "gpu" (CuPy, if it is usable) or "fake-gpu" (mpiallreduce.tools.gpu_info)."""
    local_rank, local_size = _node_local_rank(comm)
    per_rank = {
        "rank": comm.Get_rank(),
        "host": socket.gethostname(),
        "slurm_node": os.environ.get(
            "SLURMD_NODENAME"
        ),  # (Slurm's name for it: may differ from host)
        "pid": os.getpid(),
        "node_local_rank": local_rank,
        "ranks_on_node": local_size,
        "gpu": gpu_choice(local_rank),
        "launch": launch_method(),
        "slurm": slurm_variables(),
    }
    everyone = comm.gather(per_rank, root=0)
    plans = _auto_plans(comm)
    gpu = gpu_facts(comm, device)
    if comm.Get_rank() != 0:
        return None
    aware, how = cuda_aware()
    used, used_how = cuda_aware_decision()
    return {
        "mpiallreduce": __version__,
        "mpi4py": mpi4py.__version__,
        "numpy": np.__version__,
        "mpi_library": library_version(),
        "libmpi": loaded_libmpi() or "?",
        "mpi_standard": "{:d}.{:d}".format(*MPI.Get_version()),
        "thread_level": {
            MPI.THREAD_SINGLE: "single",
            MPI.THREAD_FUNNELED: "funneled",
            MPI.THREAD_SERIALIZED: "serialized",
            MPI.THREAD_MULTIPLE: "multiple",
        }.get(MPI.Query_thread(), str(MPI.Query_thread())),
        "ranks": comm.Get_size(),
        "cuda_aware": {True: "yes", False: "no", None: "unknown"}[aware],
        "cuda_aware_how": how,
        "cuda_aware_used": used,
        "cuda_aware_used_how": used_how,
        "device_paths": {name: device_path(REGISTRY[name], used) for name in ALGORITHMS},
        "algorithms": list(ALGORITHMS),
        "settings": settings().as_dict(),
        "reproducible_conversions": _reproducible_conversions(),
        "auto_plans": plans,
        "gpu": gpu,
        "per_rank": everyone,
    }


def _reproducible_conversions():
    """How reproducible sums of float32 run here (without importing numba, which takes a while)."""
    from importlib import metadata

    from ..reproducible.exact import KERNELS_ENV

    if os.environ.get(KERNELS_ENV, "").strip().lower() == "numpy":
        return f"numpy passes ({KERNELS_ENV}=numpy)"
    try:
        return f"compiled, the exact sums in one loop (numba {metadata.version('numba')})"
    except metadata.PackageNotFoundError:
        return "numpy passes (pip install 'mpiallreduce[fast]' compiles them with numba)"


#: the sizes at which ``info`` says what ``auto`` runs
PLAN_SIZES = (4, 4 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20)


def _auto_plans(comm):
    """{bytes: plan.describe()} of ``allreduce(float32 x, op="sum")`` on ``comm`` (collective: the
    communicator's state is made), numpy arrays; what mpiallreduce.planner decides, and why."""
    from ..api import describe_call

    return {
        nbytes: describe_call(np.empty(nbytes // 4, np.float32), comm=comm) for nbytes in PLAN_SIZES
    }


def format_report(info):
    """Human-readable text of what ``collect`` returned."""
    first = info["per_rank"][0]
    lines = [
        f"mpiallreduce      {info['mpiallreduce']}",
        f"mpi4py            {info['mpi4py']}",
        f"numpy             {info['numpy']}",
        f"MPI library       {info['mpi_library']}",
        f"libmpi loaded     {info['libmpi']}",
        f"MPI standard      {info['mpi_standard']}",
        f"thread level      {info['thread_level']}",
        f"ranks             {info['ranks']}",
        f"launched by       {first['launch']}",
        f"CUDA-aware MPI    {info['cuda_aware']}  (asked through {info['cuda_aware_how']})"
        if info["cuda_aware"] != "unknown"
        else f"CUDA-aware MPI    unknown  ({info['cuda_aware_how']})",
        "device arrays     "
        f"{'straight to MPI' if info['cuda_aware_used'] else 'staged through host memory'}  "
        f"({info['cuda_aware_used_how']}; {CUDA_AWARE_ENV}=1|0 overrides)",
        f"algorithms        {', '.join(info['algorithms'])}",
        "path of CuPy arrays, by algorithm:",
    ] + [f"  {name:<20} {path}" for name, path in info["device_paths"].items()]
    lines.append(f"reproducible float32 sums: {info['reproducible_conversions']}")
    lines.append(f"what auto runs here (float32 sum, {info['ranks']} ranks; mpiallreduce.planner):")
    lines += [
        f"  {int(nbytes):>10} B  {text}" for nbytes, text in info.get("auto_plans", {}).items()
    ]
    if info.get("gpu"):
        lines += format_gpu(info["gpu"])
    lines.append(
        "settings          " + ", ".join(f"{k}={v!r}" for k, v in info.get("settings", {}).items())
    )
    slurm = first["slurm"]
    if slurm:
        lines.append("Slurm variables   " + "  ".join(f"{k}={v}" for k, v in slurm.items()))
    else:
        lines.append("Slurm variables   none (not inside a Slurm job)")
    ntasks = slurm.get("SLURM_NTASKS")
    if ntasks and ntasks.isdigit() and int(ntasks) > info["ranks"] == 1:
        lines.append(
            f"WARNING           Slurm says {ntasks} tasks but MPI sees 1 rank: this process is a "
            "singleton (srun without --mpi=pmix?)"
        )
    slurm_nodes = any(r.get("slurm_node") for r in info["per_rank"])
    lines.append(
        "rank  host                  "
        + ("slurm node   " if slurm_nodes else "")
        + "pid      node-local rank"
    )
    for r in info["per_rank"]:
        gpu = r.get("gpu")
        node = f"{r.get('slurm_node') or '-':<12} " if slurm_nodes else ""
        lines.append(
            f"{r['rank']:<5} {r['host']:<21} {node}{r['pid']:<8} {r['node_local_rank']} of "
            f"{r['ranks_on_node']}" + (f"   GPU {gpu[0]} (device {gpu[1]})" if gpu else "")
        )
    return "\n".join(lines)
