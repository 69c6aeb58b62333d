"""``python -m mpiallreduce.train``: the training program (its code: mpiallreduce.tools.train)."""

from .tools.train import *  # noqa: F401,F403
from .tools.train import main

if __name__ == "__main__":
    import mpiallreduce as mar

    mar.exit_after_rank_failures(
        main()
    )  # sys.exit, but not through a finalize that waits for the dead
