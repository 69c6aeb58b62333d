"""DistributedOptimizer: any torch optimizer, with gradients averaged over the ranks before
``step()``, reduced in GradientSync buckets while backward still runs; and the broadcasts that make
replicas.

    a core to spare:  backward: hook(p) ──ready──> buckets ──allreduce in the background──┐
                      step():   synchronize() ── wait, write back ───────────────────────────┴
                                ──> optimizer.step()
    one core a rank:  step():   synchronize() ── ready(p) for each p ── wait: allreduce, write back
                                ──> optimizer.step()

Where the rank has a core to spare (GradientSync's ``overlap``: mpiallreduce.training.overlap),
each parameter's gradient is handed over from a post-accumulate-grad hook, and full buckets are
allreduced during backward, whatever order the hooks fire in. Elsewhere no hook is registered (a
hook costs backward about 10 us per parameter, and nothing would overlap): ``synchronize()`` hands
every gradient over at once. The buckets are fixed from ``named_parameters`` (as DDP's). It takes
Horovod's arguments too (``compression=Compression.fp16``, ``backward_passes_per_step``,
``gradient_predivide_factor``, ``op=Average``) and is a ``torch.optim.Optimizer`` to LR schedulers,
its param groups and state the wrapped optimizer's.
"""

import contextlib
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal, TypeVar, overload

import torch
from mpi4py import MPI

from ..core.annotations import Array, Timeout
from ..core.gather import gather_from_ranks
from .gradients import GradientSpec, GradientSync
from .gradients import broadcast_parameters as _broadcast_arrays
from .torch_tensors import _as_array, _as_tensor, _numpy_dtype, default_comm

__all__ = [
    "DistributedOptimizer",
    "Compression",
    "broadcast_parameters",
    "broadcast_optimizer_state",
]


class _Codec:
    """A Compression member: its name (what GradientSync takes), and Horovod's ``compress`` and
    ``decompress`` of a tensor (floating point to 16 bits and back; others as they are)."""

    _dtypes = {None: None, "fp16": torch.float16, "bf16": torch.bfloat16}

    def __init__(self, name: str | None) -> None:
        self.name = name

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
        """(the tensor in 16 bits, the context ``decompress`` takes: its own dtype)."""
        narrow = self._dtypes[self.name]
        if narrow is None or not tensor.dtype.is_floating_point:
            return tensor, tensor.dtype
        return tensor.to(narrow), tensor.dtype

    def decompress(self, tensor: torch.Tensor, context: torch.dtype) -> torch.Tensor:
        return tensor if tensor.dtype == context else tensor.to(context)

    def __repr__(self) -> str:
        return f"Compression.{self.name or 'none'}"


class Compression:
    """Horovod's compression choices: gradients travel in 16 bits and are summed in float32 (Horovod
    sums fp16 in fp16), rounded once (mpiallreduce.training.compression)."""

    none = _Codec(None)
    fp16 = _Codec("fp16")
    bf16 = _Codec("bf16")


def compression_name(compression: "str | _Codec | None") -> str | None:
    """None, "fp16" or "bf16", from a name or a Compression member."""
    return compression.name if isinstance(compression, _Codec) else compression


class DistributedOptimizer(torch.optim.Optimizer):
    """Wraps ``optimizer``: gradients are averaged (or summed) over the ranks before ``step()``.

    Args:
        optimizer: any torch optimizer.
        named_parameters: ``model.named_parameters()``: the parameters whose gradients to
            synchronize; their buckets are fixed from these, in reverse order (collective: the
            ranks compare names, shapes and dtypes here). None: the optimizer's parameters, named
            by their place in its param groups.
        find_unused: a parameter that got no gradient on this rank in a step (a branch not taken
            here) counts as zeros here, and gets the other ranks' mean (DDP's
            ``find_unused_parameters``); without it, that is a ValueError on every rank.
        compression: None, "fp16" or "bf16" (or Compression.fp16...): gradients travel in 16 bits,
            summed in float32.
        reproducible: True: the same bits whatever the bucket size, algorithm or rank order
            (mpiallreduce.reproducible).
        backward_passes_per_step: gradients accumulate locally over this many backward passes,
            and the last one reduces them (Horovod's; as ``no_sync`` around the others).
        gradient_predivide_factor: Horovod's: scale by 1/f before the sum and f after it.
        comm, bucket_bytes, op, algorithm, prescale, postscale, timeout, overlap: as GradientSync
            (comm: ``hvd.init(comm)``'s by default, else COMM_WORLD; overlap: hooks during backward
            or not, see above).
        gradient_as_bucket_view: True (default): a fused gradient is not copied back
            from its bucket; ``grad.set_`` points it at its result there (as Horovod's ``set_``,
            DDP's ``gradient_as_bucket_view``): the same tensor, a copy less, its memory the
            bucket's until the step after next (GradientSync's ``write_back=False``). False: copied.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
        comm: MPI.Intracomm | None = None,
        bucket_bytes: int = 25 * 2**20,
        op: Literal["mean", "sum"] = "mean",
        algorithm: str = "auto",
        prescale: float = 1.0,
        postscale: float = 1.0,
        timeout: Timeout = None,
        find_unused: bool = False,
        compression: "str | _Codec | None" = None,
        reproducible: bool = False,
        backward_passes_per_step: int = 1,
        gradient_predivide_factor: float = 1.0,
        overlap: bool | None = None,
        gradient_as_bucket_view: bool = True,
    ) -> None:
        self.optimizer = optimizer
        comm = default_comm() if comm is None else comm
        if named_parameters is None:
            named_parameters = [
                (f"param.{i}.{j}", p)
                for i, group in enumerate(optimizer.param_groups)
                for j, p in enumerate(group["params"])
            ]
        named_parameters = list(named_parameters)
        _agree_on_names(comm, _naming_problem(optimizer, named_parameters), timeout)
        self.named_parameters = [(name, p) for name, p in named_parameters if p.requires_grad]
        #: Horovod's: parameter -> its name
        self._parameter_names = {p: name for name, p in self.named_parameters}
        #: name -> (parameter, its sparse gradient made dense), this step
        self._sparse: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        if int(backward_passes_per_step) < 1:
            raise ValueError(
                f"backward_passes_per_step must be 1 or more, got {backward_passes_per_step}"
            )
        self.backward_passes_per_step = int(backward_passes_per_step)
        self._passes: dict[str, int] = {}
        self._options: dict[str, Any] = dict(
            bucket_bytes=bucket_bytes,
            op=op,
            algorithm=algorithm,
            prescale=prescale / gradient_predivide_factor,
            postscale=postscale * gradient_predivide_factor,
            timeout=timeout,
            find_unused=find_unused,
            compression=compression_name(compression),
            reproducible=reproducible,
            overlap=overlap,
            write_back=not gradient_as_bucket_view,
        )
        self._skip = self._synchronized = False
        self.parameters = [p for _, p in self.named_parameters]
        self._by_name = dict(self.named_parameters)
        # name -> (parameter, its bfloat16 gradient widened to float32), this step
        self._widened: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        #: name -> ((a result handed over, its tensor), ...): the last two
        self._tensors: dict[str, tuple[tuple[Array, torch.Tensor], ...]] = {}
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self.rebind(comm)

    def rebind(self, comm: MPI.Intracomm) -> None:
        """Synchronize over ``comm`` from now on (a survivors' communicator after a rank failure;
        collective over it)."""
        specs = {
            name: GradientSpec(tuple(p.shape), _numpy_dtype(p.dtype), p.is_cuda)
            for name, p in self.named_parameters
        }
        self.sync = GradientSync(comm=comm, parameters=specs, **self._options)
        for hook in self._hooks:
            hook.remove()
        self._hooks = (
            [
                p.register_post_accumulate_grad_hook(self._hook(name))
                for name, p in self.named_parameters
            ]
            if self.sync.overlap
            else []
        )

    def _hook(self, name: str) -> Callable[[torch.Tensor], None]:
        def ready(parameter: torch.Tensor) -> None:
            self._synchronized = False
            passes = self._passes[name] = self._passes.get(name, 0) + 1
            if passes < self.backward_passes_per_step:  # (Horovod's local accumulation)
                return
            self._passes[name] = 0
            if not self.sync.in_no_sync:  # (in it, gradients only accumulate: nothing to hand over)
                self._hand_over(name, parameter)

        return ready

    def _hand_over(self, name: str, parameter: torch.Tensor) -> None:
        grad = parameter.grad
        assert grad is not None  # (handed over once accumulated; _synchronize skips the others)
        if grad.is_sparse:  # (reduced dense, given back sparse at step(): docs/training.md)
            grad = grad.to_dense()
            self._sparse[name] = (parameter, grad)
        if grad.dtype == torch.bfloat16:
            grad = grad.float()  # (on torch's stream; rounded back once at step())
            self._widened[name] = (parameter, grad)
        self.sync.ready(_as_array(grad), name=name)

    def no_sync(self) -> contextlib.AbstractContextManager[GradientSync]:
        """``with optimizer.no_sync():`` backward passes accumulate gradients locally (DDP's
        ``no_sync``); the first backward outside it reduces the accumulated gradients once."""
        return self.sync.no_sync()

    def synchronize(self) -> None:
        """Wait for every bucket; gradients then hold the mean over the ranks."""
        self._synchronize()
        self._synchronized_grads = (
            self._grad_versions()
        )  # (step() compares: a backward since then?)

    def _synchronize(self) -> None:
        if not self._hooks and not self.sync.in_no_sync:  # (no core to spare: every gradient now)
            ready, bfloat16 = self.sync.ready, torch.bfloat16
            for name, parameter in self.named_parameters:
                grad = parameter.grad
                if grad is None:
                    continue
                if (
                    not grad.is_cuda
                    and grad.dtype != bfloat16
                    and not grad.requires_grad
                    and not grad.is_sparse
                ):  # (numpy sees it as it is)
                    ready(grad.numpy(), name=name)
                else:
                    self._hand_over(name, parameter)
        results = (
            self.sync.wait()
        )  # (those not written into the gradients: handed over, or unused here)
        widened, self._widened = self._widened, {}
        sparse, self._sparse = self._sparse, {}
        if sparse:
            results = self._take_sparse(sparse, dict(results or {}))
        if any(p.is_cuda for p in self.parameters):
            import cupy

            # the write-backs, before torch's step reads them (once a step)
            cupy.cuda.get_current_stream().synchronize()
        if widened or results:
            self._take_results(widened, results)
        self._synchronized = True

    def _take_sparse(
        self, sparse: dict[str, tuple[torch.Tensor, torch.Tensor]], results: dict[str, Array]
    ) -> dict[str, Array]:
        """Each sparse gradient given its reduced values, as a sparse tensor (Horovod's
        ``zero_().add_()``: a sparse tensor takes no ``set_``); the other results."""
        with torch.no_grad():
            for name, (parameter, dense) in sparse.items():
                result = results.pop(name, None)
                reduced = dense if result is None else _as_tensor(result, dense).to(dense.dtype)
                assert parameter.grad is not None  # (its sparse gradient, made dense above)
                parameter.grad.zero_().add_(reduced.to_sparse())
        return results

    def _take_results(
        self, widened: dict[str, tuple[torch.Tensor, torch.Tensor]], results: dict[str, Array]
    ) -> None:
        """Point each gradient at its result (a view of a bucket's buffer, or a parameter unused
        here: the other ranks' gradients; in the accumulation dtype, float32 for 16-bit ones) with
        ``grad.set_``, as Horovod does: the same tensor, no copy; and round the widened ones
        back."""
        with torch.no_grad():
            by_name = self._by_name
            for name, result in results.items():
                parameter = by_name[name]
                if widened:
                    widened.pop(name, None)
                grad, current = self._tensor_of(name, result, parameter), parameter.grad
                if current is None:
                    parameter.grad = (
                        grad.detach()
                    )  # (a tensor of its own: a later set_ moves it, not the kept one)
                elif grad.is_cuda:  # (a CuPy array of its own: into torch's memory)
                    current.copy_(grad)
                else:  # (torch's stubs lack set_(Tensor), which torch has)
                    current.set_(grad)  # type: ignore[call-overload]
            for parameter, wide in widened.values():
                assert parameter.grad is not None  # (the bfloat16 gradient widened above)
                parameter.grad.copy_(wide)

    def _tensor_of(self, name: str, result: Array, parameter: torch.Tensor) -> torch.Tensor:
        """``result`` as a tensor of ``parameter``'s dtype, sharing its memory where it has that
        dtype: made once for each of a bucket's two views of a gradient (the same arrays, turn after
        turn)."""
        kept = self._tensors.get(name, ())
        for array, tensor in kept:
            if array is result:
                return tensor
        like = (
            torch.empty(0, dtype=torch.float32, device=parameter.device)
            if parameter.dtype in (torch.float16, torch.bfloat16)
            else parameter
        )
        tensor = _as_tensor(result, like).to(parameter.dtype)
        if tensor.dtype == like.dtype:  # (a view: kept, with the last one)
            self._tensors[name] = (*kept[-1:], (result, tensor))
        return tensor

    def _grad_versions(self) -> list[tuple[int, int] | None]:
        """Which gradients the parameters hold, and how often each was written (a new backward
        changes them: without hooks, that is how step() knows a synchronize() is stale)."""
        return [None if p.grad is None else (id(p.grad), p.grad._version) for p in self.parameters]

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Horovod's: ``optimizer.synchronize()``, then change the gradients (clip them), then
        ``with optimizer.skip_synchronize(): optimizer.step()``, which does not wait again."""
        self._skip = True
        try:
            yield
        finally:
            self._skip = self._synchronized = False

    @overload
    def step(self, closure: None = None) -> None: ...
    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        if self._synchronized and not self._skip:  # (Horovod's warning, in its words)
            warnings.warn(
                "optimizer.step() called without optimizer.skip_synchronize() context after "
                "optimizer.synchronize(): the gradients are reduced again only where they changed "
                "since (a backward, a clipping); use the context to step on them as they are",
                stacklevel=2,
            )
            if not self._hooks and self._grad_versions() != self._synchronized_grads:
                self._synchronize()
        elif not self._skip:
            self._synchronize()
        self._synchronized = False
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)

    # the wrapped optimizer's, for LR schedulers and anything else that reads an Optimizer
    @property  # (torch's are attributes: these are the wrapped optimizer's)
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.optimizer!r})"


def _naming_problem(
    optimizer: torch.optim.Optimizer, named_parameters: list[tuple[str, torch.Tensor]]
) -> str | None:
    """What is wrong with ``named_parameters`` (Horovod's checks), or None."""
    if any(not (isinstance(item, tuple) and len(item) == 2) for item in named_parameters):
        return (
            "named_parameters should be a sequence of (name, parameter) tuples, as "
            "model.named_parameters() gives"
        )
    names = [name for name, _ in named_parameters]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        return f"the names in named_parameters must be unique; repeated: {', '.join(duplicates)}"
    named = {id(p) for _, p in named_parameters}
    unnamed = [
        tuple(p.shape) for group in optimizer.param_groups for p in group["params"]
        if id(p) not in named
    ]  # fmt: skip
    if unnamed:
        return (
            f"named_parameters was given, but {len(unnamed)} of the optimizer's parameters are "
            f"not in it (shapes {unnamed[:4]})"
        )
    return None


def _agree_on_names(comm: MPI.Intracomm, problem: str | None, timeout: Timeout) -> None:
    """Raise on every rank where ``problem`` is not None on some rank (before the ranks plan)."""
    everyone = gather_from_ranks(comm, problem, timeout)
    wrong = [(rank, reason) for rank, reason in enumerate(everyone) if reason is not None]
    if wrong:
        raise ValueError(
            f"rank {comm.Get_rank()}: DistributedOptimizer: "
            + "; ".join(f"rank {rank}: {reason}" for rank, reason in wrong)
        )


#: what broadcast_parameters takes (and returns): a state_dict(), named_parameters(), or tensors
Parameters = TypeVar(
    "Parameters", bound=dict[str, Any] | Iterable[tuple[str, torch.Tensor]] | Iterable[torch.Tensor]
)
AnyOptimizer = TypeVar("AnyOptimizer", bound=torch.optim.Optimizer)


def broadcast_parameters(
    state_dict: Parameters,
    root: int | None = None,
    comm: MPI.Intracomm | None = None,
    root_rank: int = 0,
) -> Parameters:
    """Copy rank ``root``'s tensors (a ``state_dict()``, ``named_parameters()``, or a list of
    tensors) into every rank's, in place. ``root_rank``: Horovod's name for ``root``."""
    root = root_rank if root is None else root
    arrays: dict[str, Array] | list[Array]
    if isinstance(state_dict, dict):
        arrays = {
            name: _as_array(t) for name, t in state_dict.items() if isinstance(t, torch.Tensor)
        }
    else:
        items: list[Any] = list(state_dict)
        named = all(isinstance(item, tuple) and len(item) == 2 for item in items)
        arrays = (
            {name: _as_array(t) for name, t in items} if named else [_as_array(t) for t in items]
        )
    _broadcast_arrays(arrays, root=root, comm=default_comm() if comm is None else comm)
    return state_dict


def broadcast_optimizer_state(
    optimizer: AnyOptimizer,
    root: int | None = None,
    comm: MPI.Intracomm | None = None,
    root_rank: int = 0,
) -> AnyOptimizer:
    """Give every rank rank ``root``'s optimizer state (moments, step counts, hyper-parameters);
    ``root_rank``: Horovod's name for ``root``. An optimizer with no state yet first takes a step
    on zero gradients (given to the parameters that have none), as Horovod's does, so that there
    is a state to send."""
    root = root_rank if root is None else root
    comm = default_comm() if comm is None else comm
    inner = optimizer.optimizer if isinstance(optimizer, DistributedOptimizer) else optimizer
    if not inner.state:  # (Horovod's: a step on zero gradients makes the state there is to send)
        kept = [
            (parameter, parameter.grad)
            for group in inner.param_groups
            for parameter in group["params"]
            if parameter.requires_grad
        ]
        for parameter, _ in kept:  # (every gradient zero: leftover ones would move the weights)
            parameter.grad = torch.zeros_like(parameter)
        inner.step()
        for parameter, grad in kept:  # (those that had none keep the zeros, as Horovod's)
            if grad is not None:
                parameter.grad = grad
    state = comm.bcast(inner.state_dict() if comm.Get_rank() == root else None, root=root)
    if comm.Get_rank() != root:
        inner.load_state_dict(state)
    return optimizer
