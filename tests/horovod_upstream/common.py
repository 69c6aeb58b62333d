# A stand-in for Horovod's test/utils/common.py (which imports horovod.runner): the three helpers
# test_torch.py takes from it, written here.
import contextlib
import os
import tempfile


def mpi_env_rank_and_size():
    for rank, size in (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE")):
        if rank in os.environ and size in os.environ:
            return int(os.environ[rank]), int(os.environ[size])
    return 0, 1


@contextlib.contextmanager
def temppath():
    with tempfile.TemporaryDirectory() as folder:
        yield os.path.join(folder, "temp_test_file")


def skip_or_fail_gpu_test(test, message):
    if int(os.environ.get("HOROVOD_TEST_GPU", 0)):
        test.fail(message)
    else:
        test.skipTest(message)
