"""How one plan's data moves, once the signature is compared: the local copy, the runs an algorithm
bound once, or the route (compressed, the reproducible sum's words, widened to the accumulation
dtype, or plain) through the algorithm on host memory, through the device path, or on pinned host
memory (a round trip); then a mean's division (by each slice's owner where the algorithm
finishes_slices). The steps of mpiallreduce.core.executor.Execution.run, which inherits them
(RunPaths), float errors masked.
"""

import numpy as np

from ..algorithms.base import CallTags
from ..faults.bounded import timed_communicator
from . import buffers
from .consistency import CarriedSignature
from .ops import OPS, ignore_float_errors, restore_float_errors
from .plan_cases import Route

__all__ = ["RunPaths"]


class RunPaths:
    """The run's steps of an Execution (its attributes: mpiallreduce.core.executor)."""

    __slots__ = ()

    def _reduce(self, send, recv, sequence, timeout, xp, watch, bounded=False):
        plan, op, size = self.plan, self.op, self.state.size
        if plan.local_only:
            if send is not None:
                buffers.copy_into(recv, send)
            op.finish(recv, size)
            return
        if (
            self.runs is not None and timeout is None and xp is None
        ):  # (the algorithm's own, bound once)
            self.runs(send, recv, sequence, watch)
            return op.finish(recv, size)
        options = self.options
        if plan.algorithm.takes_call_number:
            options = dict(options, sequence=sequence)
        if plan.inner_on_tags:
            options = dict(options, wrap=lambda comm: CallTags(comm, sequence, watch))
        if (
            self.carried or plan.algorithm.needs_symmetric
        ):  # (single_copy's arrival: the placement always
            carried = CarriedSignature(self, sequence, timeout if bounded else None)
            options = dict(options, signature=carried)  # compared, agreed once or not)
        if bounded:  # (MPI's collectives on the timed calls' communicator, bounded)
            collectives = timed_communicator(self.state, sequence, timeout)
            comm = CallTags(self.state.library, sequence, watch, collectives=collectives)
        elif plan.algorithm.messages_only:
            comm = CallTags(self.state.library, sequence, watch)
        else:
            comm = self.state.library
        if (
            xp is not None and plan.device_path == "host round trip"
        ):  # the whole call on pinned host memory
            from ..device.transports import pinned, pinned_in_use

            if bounded:  # (a collective given up may write into it later: host memory of its own)
                host = np.empty(recv.size, recv.dtype)
                xp.asnumpy(recv if send is None else send, out=host)
                self._route(comm, None, host, None, options)
                recv.set(host, stream=xp.cuda.get_current_stream())  # (pageable: read at once)
                return
            host = pinned(xp, "round_trip", recv.size, recv.dtype)
            xp.asnumpy(
                recv if send is None else send, out=host
            )  # blocking: waits for the current stream
            self._route(comm, None, host, None, options)
            stream = xp.cuda.get_current_stream()
            recv.set(host, stream=stream)  # asynchronous: `host` is read after this call returns
            pinned_in_use(xp, "round_trip", stream)
            return
        self._route(comm, send, recv, xp, options)

    def divide(self, result):
        """A mean's division of the direct path's sum (float errors ignored, as everywhere here)."""
        ignoring = ignore_float_errors()
        try:
            if self.divides_host is not None:
                self.divides_host(result)
            else:
                self.op.finish(result, self.state.size)
        finally:
            restore_float_errors(ignoring)

    def _route(self, comm, send, recv, xp, options):
        plan, op, size = self.plan, self.op, self.state.size
        if plan.route.compressed:  # the op runs on its own (mpiallreduce.training.compression)
            if send is not None:
                buffers.copy_into(recv, send)
            op.reduce_whole(self.state.library, recv)
        elif plan.route is Route.REPRODUCIBLE_WORDS:
            from ..reproducible.routes import sum_by_words

            def allreduce_in_place(array, step_op):
                plan.algorithm.run(
                    comm, None, array, OPS[step_op], buffers.mpi_datatype(array.dtype), **options
                )

            allreduce_in_place.size = size
            sum_by_words(send, recv, op.mean, allreduce_in_place)
        elif (
            plan.accumulate is not None
        ):  # float16/bfloat16 (or its words): accumulate in float32, round once
            wide = op.widen(recv if send is None else send, plan.accumulate)
            self._algorithm(
                comm,
                None,
                wide,
                buffers.mpi_datatype(plan.accumulate),
                xp,
                options,
                op.widened_op(),
            )
            op.finish(wide, size)
            op.narrow(wide, recv)
        else:
            # (a mean's division: by each slice's owner where the algorithm finishes_slices, else
            # after)
            sliced = (
                plan.algorithm.finishes_slices and op.divide_by_size and size != 1 and xp is None
            )
            self._algorithm(
                comm,
                send,
                recv,
                self.datatype,
                xp,
                dict(options, finish=lambda v: op.finish(v, size)) if sliced else options,
                op,
            )
            if not sliced:
                op.finish(recv, size)

    def _algorithm(self, comm, send, recv, datatype, xp, options, op):
        if xp is None:
            self.plan.algorithm.run(comm, send, recv, op, datatype, **options)
        else:
            from ..device.transports import run_on_device

            run_on_device(
                self.plan.device_path,
                self.plan.algorithm,
                comm,
                send,
                recv,
                op,
                datatype,
                xp,
                **options,
            )
