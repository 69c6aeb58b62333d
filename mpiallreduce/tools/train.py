"""A data-parallel training program: a small MLP on synthetic data made on the fly, numpy \
or PyTorch.

    mpiexec -n 4 python -m mpiallreduce.train --steps 100 --local-batch 32 --checkpoint ckpt.npz

The global batch of step s is generated from (seed, s) alone, and rank r trains on rows
[r*b, (r+1)*b) of it: p ranks with local batch b see exactly the data one process with batch p*b
sees, so their parameters match it (the test of that is in tests/). Each step prints the global
mean loss and samples per second. With --checkpoint the parameters (and the step) are saved every
--checkpoint-every steps and when SIGUSR1 or SIGTERM arrives (all ranks agree at the next step
boundary, rank 0 writes, then the program exits with EXIT_CHECKPOINTED so that a job script can
requeue itself); --resume continues from the file.

Faults: an exception on any rank aborts the whole job with its traceback (mpiallreduce's
abort_on_exception; --no-abort-on-exception to keep Python's default). With --fault-tolerant, under
ULFM (``mpiallreduce launch --fault-tolerant``), a rank that dies does not end the run: the
survivors agree (MPI_Comm_agree) that the step failed, undo it, shrink the communicator
(mpiallreduce.survivors) and redo it among themselves, the mean now over the survivors, logging
which ranks were lost. --timeout bounds each gradient allreduce's wait for the other ranks.
"""

import argparse
import os
import signal
import time

import numpy as np
from mpi4py import MPI

import mpiallreduce as mar
from mpiallreduce.faults import caused_by_rank_failure, failed_ranks

__all__ = ["main", "global_batch", "NumpyMLP"]

EXIT_CHECKPOINTED = 99
INPUTS, HIDDEN, OUTPUTS = 16, 32, 4


def global_batch(seed, step, size):
    """(x, y) of the whole step's batch, the same on every rank whatever the rank count."""
    rng = np.random.default_rng([seed, step])
    x = rng.standard_normal((size, INPUTS))
    teacher = np.random.default_rng([seed, 10**9]).standard_normal((INPUTS, OUTPUTS))
    return x, np.sin(x @ teacher)


def initial_parameters(seed):
    rng = np.random.default_rng([seed, 10**9 + 1])
    return {
        "w1": rng.standard_normal((INPUTS, HIDDEN)) / np.sqrt(INPUTS),
        "b1": np.zeros(HIDDEN),
        "w2": rng.standard_normal((HIDDEN, OUTPUTS)) / np.sqrt(HIDDEN),
        "b2": np.zeros(OUTPUTS),
    }


class NumpyMLP:
    """tanh MLP with hand-written backward; gradients averaged with GradientSync."""

    def __init__(self, params, lr, comm, sync_options):
        self.params = params
        self.lr = lr
        self.sync_options = sync_options
        self.rebind(comm)

    def rebind(self, comm):
        """Synchronize over ``comm`` from now on (the survivors' communicator after a rank
        failure)."""
        self.sync = mar.GradientSync(comm=comm, parameters=self.params, **self.sync_options)

    def snapshot(self):
        return {k: v.copy() for k, v in self.params.items()}

    def restore(self, snapshot):
        for k, v in snapshot.items():
            np.copyto(self.params[k], v)

    def step(self, x, y):
        p = self.params
        h = np.tanh(x @ p["w1"] + p["b1"])
        out = h @ p["w2"] + p["b2"]
        diff = out - y
        loss = float(np.mean(diff**2))
        d_out = 2 * diff / diff.size
        grads = {"w2": h.T @ d_out, "b2": d_out.sum(0)}
        d_h = (d_out @ p["w2"].T) * (1 - h**2)
        grads.update(w1=x.T @ d_h, b1=d_h.sum(0))
        for name in ("b2", "w2", "b1", "w1"):  # as backward produces them
            self.sync.ready(grads[name], name=name)
        self.sync.wait()
        for name, g in grads.items():
            p[name] -= self.lr * g
        return loss

    def arrays(self):
        return self.params


class TorchMLP:
    """The same model in PyTorch, with DistributedOptimizer (bucket allreduces from gradient
    hooks)."""

    def __init__(self, params, lr, comm, sync_options, device="cpu"):
        import torch

        import mpiallreduce.torch as mt

        self.torch = torch
        if device == "cuda":  # one GPU per node-local rank (mpiallreduce.select_gpu)
            torch.cuda.set_device(mar.select_gpu())
        self.device = torch.device(device)
        torch.set_default_dtype(torch.float64)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(INPUTS, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUTPUTS)
        ).to(self.device)
        self.load(params)
        self.sync_options = sync_options
        self.optimizer = mt.DistributedOptimizer(
            torch.optim.SGD(self.model.parameters(), lr=lr),
            named_parameters=self.model.named_parameters(),
            comm=comm,
            **sync_options,
        )
        mt.broadcast_parameters(self.model.state_dict(), root=0, comm=comm)
        mt.broadcast_optimizer_state(self.optimizer, root=0, comm=comm)

    def rebind(self, comm):
        """Synchronize over ``comm`` from now on (the survivors' communicator after a rank
        failure)."""
        self.optimizer.rebind(comm)

    def snapshot(self):
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def restore(self, snapshot):
        self.model.load_state_dict(snapshot)

    def load(self, params):
        tensor = self._tensor
        with self.torch.no_grad():
            self.model[0].weight.copy_(tensor(params["w1"].T.copy()))
            self.model[0].bias.copy_(tensor(params["b1"]))
            self.model[2].weight.copy_(tensor(params["w2"].T.copy()))
            self.model[2].bias.copy_(tensor(params["b2"]))

    def _tensor(self, array):
        return self.torch.from_numpy(array).to(self.device)

    def step(self, x, y):
        self.optimizer.zero_grad()
        loss = self.torch.nn.functional.mse_loss(self.model(self._tensor(x)), self._tensor(y))
        loss.backward()
        self.optimizer.step()
        return float(loss.detach())  # (float() of a tensor that requires grad warns)

    def arrays(self):
        m = self.model
        host = lambda t: t.detach().cpu().numpy()  # noqa: E731
        return {
            "w1": host(m[0].weight).T,
            "b1": host(m[0].bias),
            "w2": host(m[2].weight).T,
            "b2": host(m[2].bias),
        }


class _StopRequest:
    """Set by SIGUSR1/SIGTERM; the ranks agree on it at step boundaries."""

    def __init__(self):
        self.signal = None
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, self._handler)

    def _handler(self, signum, frame):
        self.signal = signum

    def agreed(self, comm):
        return bool(comm.allreduce(1 if self.signal else 0, op=MPI.MAX))


def agree_all_succeeded(comm, succeeded):
    """ULFM's fault-tolerant agreement: True on every survivor iff the step succeeded on all of
    them."""
    try:
        return bool(comm.Agree(int(succeeded)))
    except (
        MPI.Exception
    ):  # a failure not yet acknowledged here: acknowledge, then agree among the living
        comm.Ack_failed()
        return bool(comm.Agree(int(succeeded)))


def save_checkpoint(path, arrays, step, comm):
    if comm.Get_rank() == 0:
        partial = path + ".partial.npz"
        np.savez(partial, step=step, **{k: np.ascontiguousarray(v) for k, v in arrays.items()})
        os.replace(partial, path)
    comm.Barrier()


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m mpiallreduce.train", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--framework", choices=["numpy", "torch"], default="numpy")
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cuda: torch on the GPU of this node-local rank (with --framework torch)",
    )
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--local-batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bucket-bytes", type=int, default=25 * 2**20)
    parser.add_argument("--checkpoint", help="file to save to (and resume from with --resume)")
    parser.add_argument("--checkpoint-every", type=int, default=0)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument(
        "--save-params", help="write the final parameters here (npz), for comparison"
    )
    parser.add_argument(
        "--check-replicas", action="store_true", help="check bitwise identity after every step"
    )
    parser.add_argument(
        "--step-seconds", type=float, default=0.0, help="sleep per step (to test preemption)"
    )
    parser.add_argument("--algorithm", default="auto", help="allreduce algorithm for the gradients")
    parser.add_argument(
        "--reproducible",
        action="store_true",
        help="reproducible gradient sums: the same bits whatever the bucket size or algorithm",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds an allreduce waits for the other ranks (default MPIALLREDUCE_TIMEOUT)",
    )
    parser.add_argument(
        "--fault-tolerant",
        action="store_true",
        help="under ULFM (mpiallreduce launch --fault-tolerant): when a rank dies, go on with "
        "the survivors (the step is redone on the shrunken communicator)",
    )
    parser.add_argument(
        "--no-abort-on-exception",
        action="store_true",
        help="do not abort the whole job when a rank raises (the default aborts it)",
    )
    args = parser.parse_args(argv)
    if args.device == "cuda" and args.framework != "torch":
        parser.error("--device cuda needs --framework torch")
    if args.resume and not args.checkpoint:  # (it would start over without saying so)
        parser.error("--resume needs --checkpoint FILE, the file to resume from")
    if not args.no_abort_on_exception:
        mar.abort_on_exception()  # one rank's exception ends the job with its traceback, not a hang
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    stop = _StopRequest()

    params, start = initial_parameters(args.seed), 0
    # Rank 0 reads the checkpoint and every rank gets its contents: the ranks must agree on whether
    # there is one even where rank 0's file system is not the others'.
    saved_state = None
    if rank == 0 and args.resume and args.checkpoint and os.path.exists(args.checkpoint):
        with np.load(args.checkpoint) as saved:
            saved_state = ({k: saved[k].copy() for k in params}, int(saved["step"]))
    saved_state = comm.bcast(saved_state, root=0)
    if saved_state is not None:
        params, start = saved_state
        if rank == 0:
            print(
                f"resumed from {args.checkpoint} at step {start} "
                f"(SLURM_RESTART_COUNT={os.environ.get('SLURM_RESTART_COUNT', '-')})",
                flush=True,
            )
    sync_options = dict(
        bucket_bytes=args.bucket_bytes,
        algorithm=args.algorithm,
        timeout=args.timeout,
        reproducible=args.reproducible,
    )
    if args.framework == "numpy":
        model = NumpyMLP(params, args.lr, comm, sync_options)
    else:
        model = TorchMLP(params, args.lr, comm, sync_options, args.device)

    b = args.local_batch
    step = start
    while step < args.steps:
        begin = time.perf_counter()
        saved = model.snapshot() if args.fault_tolerant else None
        try:
            x, y = global_batch(args.seed, step, b * size)
            loss = model.step(x[rank * b : (rank + 1) * b], y[rank * b : (rank + 1) * b])
            if args.step_seconds:
                time.sleep(args.step_seconds)
            loss = comm.allreduce(loss) / size
            seconds = comm.allreduce(time.perf_counter() - begin, op=MPI.MAX)
            if args.check_replicas:  # after every step the replicas are bitwise identical
                mar.check_replicas(model.arrays(), comm=comm)
            step_failed = False
        except Exception as error:  # noqa: BLE001 - re-raised unless a rank's death caused it
            if not (args.fault_tolerant and caused_by_rank_failure(error, comm)):
                raise
            step_failed = True
        if args.fault_tolerant and not agree_all_succeeded(comm, not step_failed):
            # Some rank saw a failure during this step: every survivor undoes it and redoes it with
            # the others (the mean is then over the survivors).
            lost = failed_ranks(comm)
            model.restore(saved)
            old_size = size
            comm = mar.survivors(comm)
            rank, size = comm.Get_rank(), comm.Get_size()
            model.rebind(comm)
            if rank == 0:
                print(
                    f"rank failure at step {step + 1}: lost rank(s) "
                    f"{', '.join(map(str, lost)) or '?'} of {old_size}; redoing the step and going "
                    f"on with {size} ranks",
                    flush=True,
                )
            continue
        step += 1
        if rank == 0:
            print(
                f"step {step:>5}  loss {loss:.6f}  {b * size / seconds:,.0f} samples/s  "
                f"({size} ranks)",
                flush=True,
            )
        done = step
        if args.checkpoint and args.checkpoint_every and done % args.checkpoint_every == 0:
            save_checkpoint(args.checkpoint, model.arrays(), done, comm)
        if stop.agreed(comm):
            if args.checkpoint:
                save_checkpoint(args.checkpoint, model.arrays(), done, comm)
            if rank == 0:
                print(
                    f"signal received: checkpoint at step {done} written to {args.checkpoint}; "
                    f"exiting with {EXIT_CHECKPOINTED} to be requeued",
                    flush=True,
                )
            return EXIT_CHECKPOINTED
    if args.save_params and rank == 0:
        np.savez(
            args.save_params, **{k: np.ascontiguousarray(v) for k, v in model.arrays().items()}
        )
    if args.checkpoint:
        save_checkpoint(args.checkpoint, model.arrays(), args.steps, comm)
    return 0


if __name__ == "__main__":
    mar.exit_after_rank_failures(
        main()
    )  # sys.exit, but not through a finalize that waits for the dead
