"""What the library keeps per user communicator: one typed object, made on the caller's thread.

    user comm ──Idup──> library   every collective and message the library makes: the algorithms,
                                  MPI_Allreduce itself, the signature and settings checks, and on
                                  its own tag (TAG_UB) the rendezvous of timed calls
                                  (mpiallreduce.faults.rendezvous)

The duplicate (``MPI_Comm_idup``) is made on the first use, on the caller's thread, in program
order: the library's collectives never meet the user's own. It is waited for at once when that first
call is untimed, left pending when it is timed, so that a straggler on the first call is reported,
not waited for (one pending duplicate at most: with two, CI saw a hang; open-mpi/ompi#2025). The
first call then, on the caller's thread too, compares the settings, learns the node layout and makes
what it needs.

States are found by the communicator's handle (a dict: cheaper than an MPI attribute lookup); an
MPI attribute's delete callback frees the duplicates and forgets the state when the user's
communicator is freed (at MPI_Finalize for COMM_WORLD).
"""

import contextlib
import dataclasses
import threading
from typing import Any

import numpy as np
from mpi4py import MPI

from ..faults.errors import AllreduceAborted
from ..faults.recorder import named_members, recorder
from ..faults.recorder_signals import install_signal_handlers
from .consistency import codes_agree
from .settings import ON_RESET, settings
from .tuning import table_digest
from .worker import Worker

__all__ = [
    "CommState",
    "state_of",
    "known_state",
    "forget_plans",
    "SettingsMismatch",
    "WORLD_FAST_CALLS",
]


class SettingsMismatch(ValueError):
    """Settings that must be equal on every rank of a communicator are not."""


_lock = threading.RLock()
#: COMM_WORLD's state's ``fast_calls``: found by the short path without looking the state up
WORLD_FAST_CALLS: dict[tuple[Any, ...], Any] = {}
_states: dict[int, "CommState"] = {}  # user communicator handle -> CommState
_keyval = None


class CommState:
    """The library's state for one user communicator (see the module's docstring)."""

    def __init__(self, user, blocking=True):
        self.user = user
        self.size = user.Get_size()
        self.rank = user.Get_rank()
        #: the flight recorder (faults.recorder) or None; the ranks as COMM_WORLD's, and the
        #: recorder's name
        self.recorder, (self.members, self.trace_id) = recorder(), named_members(user)
        self.sequence = 0  # calls this rank made on the communicator that reached communication
        self.settings = settings()
        # Always MPI_Comm_idup (a blocking dup does not match it), waited for unless the first call
        # is timed (state_of: outside the lock of every state, so that another thread's first use of
        # another communicator is not held up by this one's peers)
        self.library, self._library_request = user.Idup()
        self.settings_request = self.given_up_ahead = (
            None  # (the set-up's: consistency.set_up_codes_agree)
        )
        self.control = self.library  # the rendezvous's control messages: on a tag of their own
        self.ready, self.spans_nodes, self.node_count, self.equal_nodes = False, False, 1, True
        self.facts = (
            None  # the planner's CallFacts (mpiallreduce.core.planner): agreed on, once ready
        )
        self.cuda_aware = (
            False  # whether every rank's MPI takes device pointers (agreed: all, or no)
        )
        self.cuda_ipc = (
            "untested"  # "works" or "refused: why": CUDA IPC among the ranks (learn_cuda_ipc)
        )
        self.on_free = []  # callables run when the communicator is freed
        self.broken = None  # an exception every later call re-raises (the ranks' settings differ)
        # the rendezvous's per-peer receives on ``control`` (mpiallreduce.faults.rendezvous)
        self.channel = None
        # requests of calls given up midway, kept with their buffers (faults.watch)
        self.left_behind = []
        self.held_buffers = []  # (request, buffers) of collectives left behind (faults.watch)
        #: timed calls' MPI collectives run on a duplicate of their own (faults.bounded), retired
        #: (kept, never freed) after a timed call that raised
        self.timed_collectives, self.retired_communicators = None, []
        self.timed_made_in = None  # the number of the call that made it (faults.bounded)
        self.committed_call = (
            None  # the last timed call whose rendezvous committed (faults.bounded)
        )
        #: the short path's Executions of repeated calls, by kind
        #: (mpiallreduce.core.kinds.execution_for)
        self.fast_calls = WORLD_FAST_CALLS if user == MPI.COMM_WORLD else {}
        self.signature_slots = (
            None  # on one node, the ranks' signature codes (core.slots; else messages)
        )
        self.symmetric = []  # this rank's symmetric allocations, in order (core.symmetric)
        self.lock = threading.Lock()
        #: this communicator's asynchronous calls, in its order (mpiallreduce.core.worker)
        self.worker = Worker(f"mpiallreduce-worker-{self.trace_id}")

    def keep(self, key, execution, most=256):
        """Keep ``execution`` for the short path under ``key``; past ``most`` kinds, the oldest goes
        (a long run of new kinds, as bench's sizes, keeps its short paths)."""
        if (
            len(self.fast_calls) >= most
        ):  # (another thread may change it meanwhile: pop what is first then)
            self.fast_calls.pop(next(iter(self.fast_calls.copy()), None), None)
        self.fast_calls[key] = execution

    def number(self):
        """Number the next call (1, 2, ...): every call that reaches communication is numbered here
        (or by _compiled.c's next_number, alike), on the caller's thread, in program order, so the
        numbers match across the ranks whatever thread runs it. Raises what a first use outside a
        call learnt of the call of that number (make_ready: a peer gave it up)."""
        self.sequence += 1
        ahead, self.given_up_ahead = self.given_up_ahead, None
        if ahead is not None and ahead.sequence == self.sequence:
            raise ahead
        return self.sequence

    # -- completing the duplicate --------------------------------------------------------------

    def complete_duplicate(self):
        """Wait for the duplicate (collective: the peers' first use of the communicator)."""
        with self.lock:
            if self._library_request is not None:
                self._library_request.Wait()
                self._library_request = None

    def control_ready(self):
        """Complete the duplicate if it can be without waiting; whether it is complete."""
        if self._library_request is not None and self._library_request.Test():
            self._library_request = None
        return self._library_request is None

    def make_ready(self, sequence=None, timed=None):
        """Collective over the ranks (every one is in this call): complete the duplicate, agree on
        the settings, learn the topology. Raises on every rank if the settings differ;
        AllreduceAborted where a peer gave up call #``sequence``, the one set up here
        (consistency.set_up_codes_agree). None: the next number, which a first use outside a call
        (describe_call's) takes no part of."""
        aborted = None
        if self.ready:
            if self.broken is not None:
                raise self.broken
            return self
        with self.lock:
            if self.ready:
                return self.make_ready(sequence, timed)
            if (
                sequence is None and self.given_up_ahead is not None
            ):  # (learnt already, by a first use)
                raise self.given_up_ahead
            if self._library_request is not None:
                self._library_request.Wait()
                self._library_request = None
            from ..faults.channel import announce_given_up

            announce_given_up(self)
            try:
                aborted = self._agree_on_settings(
                    self.sequence + 1 if sequence is None else sequence
                )
                self._learn_topology()
                self.ready = True
                if timed is not None:  # (a timed call's set-up, every rank here: faults.bounded;
                    from ..faults.bounded import make_timed_communicator  # its timeout bounds it)

                    make_timed_communicator(self, sequence, timed)
            except SettingsMismatch as error:
                self.broken, self.ready = error, True
            except AllreduceAborted as given_up:  # (the set-up not done: the next one does it)
                aborted = given_up
        if (
            aborted is not None and sequence is None
        ):  # (a first use outside a call, as describe_call's)
            self.given_up_ahead = aborted  # (raised by the next number(), of the call given up)
        if self.broken is not None or aborted is not None:
            raise self.broken or aborted
        return self

    def _agree_on_settings(self, sequence):
        from .consistency import describe_differences, digest, set_up_codes_agree

        agreed = self.settings.agreed(tuning_table=table_digest())
        same, aborted = set_up_codes_agree(self, digest(sorted(agreed.items())), sequence)
        if same:
            return aborted
        everyone = self.library.allgather(agreed)
        raise SettingsMismatch(
            f"rank {self.rank}: the settings that must match on every rank of this communicator of "
            f"{self.size} ranks differ (see mpiallreduce.settings):\n  "
            + "\n  ".join(describe_differences(everyone))
        )

    def _agree_on_trace_id(self):
        """The flight recorder's name of this communicator, the same on every rank: its lowest
        world rank's (which names each communicator of these members once, in the order it made
        them). Each rank's own follows the order in which it made its communicators, which
        differs between ranks where threads make them (two duplicates of COMM_WORLD, one a
        thread): their calls were then compared with the other one's."""
        number = np.array([int(self.trace_id.rsplit("#", 1)[1])], dtype=np.int64)
        self.library.Bcast([number, MPI.INT64_T], root=self.members.index(min(self.members)))
        self.trace_id = f"{self.trace_id.rsplit('#', 1)[0]}#{int(number[0])}"

    def _learn_topology(self):
        from .topology import leader_communicator, node_communicator, node_sizes, rail_communicator

        node = node_communicator(self.library)
        leaders = np.array([1 if node.Get_rank() == 0 else 0], dtype=np.int64)
        self.library.Allreduce(MPI.IN_PLACE, [leaders, MPI.INT64_T], op=MPI.SUM)
        self.node_count = int(leaders[0])
        if self.size > 1:
            self._agree_on_trace_id()
        self.spans_nodes, self.equal_nodes = self.node_count > 1, True
        if self.spans_nodes:
            self.equal_nodes = bool(codes_agree(self.library, node.Get_size()))
        if self.size > 1:
            # what hierarchical and two_level talk on, made here, in program order (see the
            # docstring)
            leader_communicator(self.library)
            rail_communicator(self.library)
            node_sizes(self.library)
        # (not under ULFM: a barrier that meets a dead rank fails there with no failed rank known)
        from ..faults.ulfm import fault_tolerant, warn_of_han

        warn_of_han(self.spans_nodes)  # (a survivor's call that returns with its result unwritten)
        if (
            self.node_count == 1
            and self.size > 1
            and self.signature_slots is None
            and not fault_tolerant()
        ):
            from .slots import SignatureSlots

            self.signature_slots = SignatureSlots(self.library)
        from ..device.arrays import agree_on_cuda_awareness

        self.cuda_aware = agree_on_cuda_awareness(self.library, self.settings.cuda_aware)
        from .compiled import used_everywhere
        from .planner import CallFacts

        self.facts = CallFacts(
            size=self.size,
            spans_nodes=self.spans_nodes,
            node_count=self.node_count,
            equal_nodes=self.equal_nodes,
            cuda_aware=self.cuda_aware,
            cuda_ipc=self.cuda_ipc,
            signature_min_bytes=self.settings.signature_min_bytes,
            shared_slots=self.signature_slots is not None,
            persistent_collectives=not fault_tolerant(),
            compiled=used_everywhere(self.library),
        )

    def learn_cuda_ipc(self, xp):
        """Probe CUDA IPC once (collective: in a call's turn, on every rank) and plan with the
        verdict."""
        if self.cuda_ipc == "untested":
            from ..algorithms.device_to_device import probe_cuda_ipc

            self.cuda_ipc = probe_cuda_ipc(self.library, xp)
            self.facts = dataclasses.replace(self.facts, cuda_ipc=self.cuda_ipc)
            self.fast_calls.clear()  # (plans made before it probe; the next ones need not)
        return self.cuda_ipc

    def renew_settings(self, current):
        """The process's settings were replaced (``settings.reset_settings``; every rank at the same
        point of its program): forget what was planned with the old ones and agree again."""
        with self.lock:
            self.settings, self.recorder, self.facts, self.ready = current, recorder(), None, False
            self.fast_calls.clear()
            if isinstance(self.broken, SettingsMismatch):
                self.broken = None

    def library_communicators(self):
        if self.library is None or self._library_request is not None:
            return ()  # (no dup made yet)
        timed = self.timed_collectives
        return (self.library,) if timed is None else (self.library, timed)

    def free(self):
        if self.library is None:  # (freed already: at exit, then by the communicator's own free)
            return
        self.worker.stop()
        for forget in self.on_free:
            forget()
        from ..faults.channel import free_channel

        free_channel(self)
        if self.signature_slots is not None:
            self.signature_slots.free()
            self.signature_slots = None
        if self._library_request is not None:
            with contextlib.suppress(MPI.Exception):
                self._library_request.Wait()
        for comm in self.library_communicators():
            if comm != MPI.COMM_NULL:
                with contextlib.suppress(MPI.Exception):  # revoked after a rank died (ULFM)
                    comm.Free()
        self.library = self.control = self.timed_collectives = None


def _forget(comm, keyval, state):
    with _lock:
        _states.pop(state.handle, None)
        if state in _made:
            _made.remove(state)
    from .worker import pending_calls_finished

    if not MPI.Is_finalized() and pending_calls_finished("the communicator's free", [state.worker]):
        state.free()


def state_of(comm, blocking=True):
    """The CommState of ``comm``, made on first use: its duplicate made (``blocking``) or started.

    Call it on the thread that makes the call, in program order: it may start a collective.
    """
    state = _states.get(comm.handle)
    if (
        state is not None
    ):  # (a freed communicator's state is forgotten: handles are not reused stale)
        return state
    return _make_state(comm, blocking)


def _make_state(comm, blocking):
    global _keyval
    if MPI.Is_finalized() or not MPI.Is_initialized():  # (Open MPI would abort: exit 14)
        raise RuntimeError(
            "mpiallreduce: MPI "
            + (
                "was finalized (MPI.Finalize() ran): no collective can run after it"
                if MPI.Is_finalized()
                else "is not initialized (mpi4py.rc.initialize = False): call MPI.Init() first"
            )
        )
    with _lock:
        state = _states.get(comm.handle)
        if state is not None:
            return state
        if _keyval is None:
            _keyval = MPI.Comm.Create_keyval(delete_fn=_forget)
        state = CommState(comm)
        state.handle, state.maker = comm.handle, threading.get_ident()
        comm.Set_attr(_keyval, state)
        _states[comm.handle] = state
        if not _made and not _made_keyval:
            if state.recorder is not None:  # (its dumps on SIGUSR1, and SIGTERM under the launcher)
                install_signal_handlers(state.settings.abort_on_exception)
            # at exit (before mpi4py's MPI_Finalize: atexit runs the last registered first), and at
            # the start of an MPI_Finalize the program calls itself (it frees COMM_SELF first, while
            # MPI still works: its attribute's delete callback)
            import atexit

            atexit.register(_free_all_before_finalize)
            _made_keyval.append(
                MPI.Comm.Create_keyval(
                    delete_fn=lambda comm, keyval, value: _free_all_before_finalize()
                )
            )
            MPI.COMM_SELF.Set_attr(_made_keyval[0], True)
        _made.append(state)
    if blocking:
        state.complete_duplicate()
    return state


#: every state, in the order it was made: program order, the same on every rank of each communicator
_made: list["CommState"] = []
_made_keyval: list[int] = []


def _free_all_before_finalize():
    """At the start of MPI_Finalize, once the asynchronous calls have ended: free every state still
    alive, the last made first (the same order on every rank of each), collectively. Inside
    MPI_Finalize Open MPI frees them in an order of its own, which differs between ranks of
    different communicators, and waits for ever (3 ranks, shared_memory on 2- and 1-rank halves)."""
    from ..faults import aborting

    if (
        MPI.Is_finalized() or aborting.exit_status() is not None
    ):  # (a rank leaving early: the job aborts)
        return
    from .worker import pending_calls_finished

    if not pending_calls_finished("exit"):
        return
    # (the thread that made each: the order of one thread's is the same on every rank)
    by_thread = {}
    for state in reversed(_made):
        with _lock:
            _states.pop(state.handle, None)
        by_thread.setdefault(state.maker, []).append(state)
    _made.clear()
    frees = [
        lambda states=states: [state.free() for state in states] for states in by_thread.values()
    ]
    if len(frees) == 1:
        frees[0]()
        return
    # States made by different threads: their order differs between ranks, so each thread's are
    # freed in an order of their own, side by side (each free is collective over its communicator
    # only)
    threads = [
        threading.Thread(target=free, name="mpiallreduce-free", daemon=True) for free in frees
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(FREE_JOIN_SECONDS)


#: how long the frees at exit of states made by different threads are waited for
FREE_JOIN_SECONDS = 60


def known_state(comm):
    """The CommState of ``comm`` if it was made (no communication), else None."""
    return _states.get(comm.handle)


def forget_plans():
    """Drop every communicator's remembered plans (the tuning table or the settings changed)."""
    with _lock:
        for state in _states.values():
            state.fast_calls.clear()


ON_RESET.append(forget_plans)
