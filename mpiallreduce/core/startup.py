"""Checks made once when mpiallreduce is imported.

The silent-singleton trap (docs/field-notes.md): Open MPI started by ``srun`` without the right PMI
plugin gives every task a world of size 1, and each "succeeds" alone. Inside a Slurm job step that
asked for more than one task, a world of one rank is refused with a clear message.
"""

import os

from mpi4py import MPI

__all__ = ["SingletonUnderSlurm", "check_world_matches_slurm", "ALLOW_SINGLETON_ENV"]

ALLOW_SINGLETON_ENV = "MPIALLREDUCE_ALLOW_SINGLETON"


class SingletonUnderSlurm(RuntimeError):
    """Slurm started several tasks, but MPI sees a world of one rank."""


def check_world_matches_slurm(environ=None, world_size=None):
    env = os.environ if environ is None else environ
    if env.get(ALLOW_SINGLETON_ENV, "").strip() in {"1", "true", "yes"}:
        return
    if "SLURM_STEP_ID" not in env:  # not inside an srun step (a batch script may run one process)
        return
    tasks = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS")
    if not (tasks and tasks.isdigit() and int(tasks) > 1):
        return
    if world_size is None:
        if not MPI.Is_initialized() or MPI.Is_finalized():
            return
        world_size = MPI.COMM_WORLD.Get_size()
    if world_size == 1:
        raise SingletonUnderSlurm(
            f"Slurm started {tasks} tasks in this step (task {env.get('SLURM_PROCID', '?')}), but "
            "MPI sees a world of 1 rank: every task is running alone. With Open MPI 5 launch with "
            "`srun --mpi=pmix` (--mpi=pmi2 or none give singletons), or use mpiexec inside the "
            f"allocation. Set {ALLOW_SINGLETON_ENV}=1 if one rank per task is really what you want."
        )
