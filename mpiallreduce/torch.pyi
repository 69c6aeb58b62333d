# What a type checker reads for ``import mpiallreduce.torch``: at run time that old path is the
# module mpiallreduce.training.torch itself (mpiallreduce.MOVED), which no checker can follow. Its
# names: Horovod's (training/horovod.py) and the DDP hooks (training/ddp_hooks.py).
from .training.ddp_hooks import *  # noqa: F403
from .training.horovod import *  # noqa: F403
