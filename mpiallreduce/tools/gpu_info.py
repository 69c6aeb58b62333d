"""``mpiallreduce info``'s GPU part: whether CuPy imports, whether a GPU is usable and why not, the
GPU's compute mode, the kernel release, the CUDA IPC probe's verdict, and what ``auto`` runs on
device arrays here (so a device check's info step says why a path is or is not taken).

    every rank   CuPy imported? a device? its compute mode?   (local)
    all ranks    usable everywhere?                          (one allreduce)
    all ranks    the CUDA IPC probe, on one node, 2+ ranks   (CommState.learn_cuda_ipc: collective)
    rank 0       the report; every rank's lines gathered
"""

import platform

from mpi4py import MPI

__all__ = ["gpu_facts", "format_gpu", "usable_cupy"]

#: cudaComputeMode's values (cudaDeviceProp.computeMode)
COMPUTE_MODES = {0: "Default", 1: "Exclusive_Thread", 2: "Prohibited", 3: "Exclusive_Process"}
#: the sizes at which ``info`` says what ``auto`` runs on device arrays
DEVICE_PLAN_SIZES = (4 << 10, 64 << 10, 1 << 20, 64 << 20)


def usable_cupy(device="gpu"):
    """(xp, why): CuPy with this rank's GPU selected, or (None, why not) in one line. ``device``
    "fake-gpu" gives mpiallreduce.testing.fake_cupy (tests, the device check's dry run)."""
    if device == "fake-gpu":
        from ..testing import fake_cupy

        return fake_cupy, "the CuPy stand-in (mpiallreduce.testing.fake_cupy)"
    try:
        import cupy
    except Exception as error:  # noqa: BLE001 - not installed, or a broken install: said as it is
        return None, f"CuPy does not import: {type(error).__name__}: {error}"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as error:  # noqa: BLE001 - no driver, a driver too old, no device
        return None, (
            f"CuPy {cupy.__version__} imports but sees no GPU: {type(error).__name__}: {error} "
            "(no NVIDIA driver, one older than CuPy's CUDA, or no device visible)"
        )
    if count == 0:
        return None, f"CuPy {cupy.__version__} imports but sees no GPU (0 devices visible)"
    from ..core.node_rank import select_gpu

    index = select_gpu(xp=cupy)
    return cupy, f"CuPy {cupy.__version__}, GPU {index} of {count}"


def _device_line(xp):
    """This rank's GPU: its name and compute mode (Exclusive_Process stops ranks sharing it)."""
    device = xp.cuda.runtime.getDevice()
    properties = xp.cuda.runtime.getDeviceProperties(device)
    name = properties.get("name", b"?")
    name = name.decode(errors="replace") if isinstance(name, bytes) else str(name)
    mode = properties.get("computeMode")
    return {"gpu": device, "name": name, "compute_mode": COMPUTE_MODES.get(mode, str(mode))}


def gpu_facts(comm=MPI.COMM_WORLD, device="gpu"):
    """Collective over ``comm``: the GPU part of ``info`` (complete on rank 0, None elsewhere)."""
    xp, why = usable_cupy(device)
    mine = {"rank": comm.Get_rank(), "cupy": why, "kernel": platform.release()}
    if xp is not None:
        try:
            mine.update(_device_line(xp))
        except Exception as error:  # noqa: BLE001 - a device that cannot be queried is not usable
            xp, mine["cupy"] = (
                None,
                f"{why}, but its properties cannot be read: {type(error).__name__}: {error}",
            )
    usable = comm.allreduce(0 if xp is None else 1, op=MPI.MIN)
    plans = {}
    if not usable:
        ipc = "not probed: a rank has no usable GPU"
    elif comm.Get_size() == 1:
        ipc = (
            "not probed: one rank "
            "(mpiallreduce launch -n 2 -- python -m mpiallreduce info probes it)"
        )
    else:
        from ..core.state import state_of

        state = state_of(comm).make_ready()
        ipc = (
            "not probed: the ranks span nodes (CUDA IPC is between the processes of one node)"
            if state.spans_nodes
            else state.learn_cuda_ipc(xp)
        )
    if usable:
        import numpy as np

        from ..api import describe_call

        plans = {
            n: describe_call(xp.empty(n // 4, dtype=np.float32), comm=comm)
            for n in DEVICE_PLAN_SIZES
        }
    everyone = comm.gather(mine, root=0)
    if comm.Get_rank() != 0:
        return None
    return {"cuda_ipc": ipc, "device_plans": plans, "per_rank": everyone}


def format_gpu(facts):
    """The lines ``info`` prints for ``gpu_facts``'s result."""
    lines = [
        f"kernel release    {facts['per_rank'][0]['kernel']}",
        f"CUDA IPC          {facts['cuda_ipc']}",
    ]
    for r in facts["per_rank"]:
        gpu = (
            f"; GPU {r['gpu']} {r['name']}, compute mode {r['compute_mode']}" if "gpu" in r else ""
        )
        lines.append(f"  rank {r['rank']:<3} {r['cupy']}{gpu}")
    if facts["device_plans"]:
        lines.append("what auto runs on device arrays here (float32 sum):")
        lines += [f"  {n:>10} B  {text}" for n, text in facts["device_plans"].items()]
    return lines
