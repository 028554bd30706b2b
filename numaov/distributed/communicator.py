"""Collectives between the ranks of a group, and the registry that finds them by group name.

Two transports share one interface (:class:`Communicator`), so call sites never branch on the
backend:

- :class:`ShmCommunicator`: numaov's C++ shared-memory communicator (``csrc/communicator/communicator.cpp``),
  for ranks on one host. Creating one joins the group (every rank must create it) and registers
  it under its group name.
- :class:`GlooCommunicator`: ``torch.distributed`` with an existing process group, the reference
  the shared-memory one is tested and benchmarked against.

There is one group registry per process, the C++ one (``csrc/communicator/communicator.hpp``): the Python
functions below read and write it, and OpenVINO's collective ops read it, so a name means the
same communicator everywhere. A :class:`GlooCommunicator` takes its name there too, but
OpenVINO's ops cannot run on ``torch.distributed``: their lookup of such a name is refused with
a message naming the transport, never a silent "not found".

Buffers are numpy arrays or CPU torch tensors, C-contiguous, of float32, bfloat16 or float16.
Sums are computed in fp32 in rank order and rounded to nearest even, so every rank gets the same
bits; the ops that only move data (all_gather_into_tensor, all_to_all, broadcast) copy bytes
unchanged. all_to_all is ``torch.distributed.all_to_all_single`` with equal splits only: dim 0
split into world_size equal blocks (Ulysses sequence parallelism needs no other).

Every wait is bounded by ``timeout_s`` (default ``$NUMAOV_COLL_TIMEOUT_S``, else 60 s).
Any error inside a shared-memory collective — a mismatch between ranks, a timeout, a dead peer,
a bad argument, a bad input to one of OpenVINO's collective ops — is raised as
:class:`CollectiveError` on every rank of the group, and the communicator refuses further calls:
create a new one.

Segment names are built from the user id, the host, a job id and the group name. The job id is
the ``job_id`` argument, else ``$NUMAOV_JOB_ID``, else the session id of the process, which
every process one launcher starts shares; ranks started from different shells must set the same
``NUMAOV_JOB_ID``.
"""

from __future__ import annotations

import functools
import logging
import sys
from abc import ABC, abstractmethod
from types import ModuleType
from typing import Any, NoReturn

import numpy as np

from numaov import NumaovError
from numaov.arrays import to_torch
from numaov.native import native_module

logger = logging.getLogger(__name__)

__all__ = [
    "CollectiveError",
    "Communicator",
    "GlooCommunicator",
    "ShmCommunicator",
    "destroy_communicator",
    "find_communicator",
    "reclaim_stale_segment",
    "register_communicator",
    "shm_bytes_needed",
]


class CollectiveError(NumaovError):
    """A collective failed (mismatch, timeout, dead peer, bad buffer) or a group is unknown."""


# dtype codes of numaov::DType (csrc/communicator/communicator.hpp).
_F32, _BF16, _F16 = 0, 1, 2
# numpy has no bfloat16 of its own; ml_dtypes' is recognised by name.
_NUMPY_CODES = {"float32": _F32, "bfloat16": _BF16, "float16": _F16}
# torch.dtype -> code, filled on first use (torch is not imported here).
_TORCH_CODES: dict[Any, int] = {}
_EXPECTED_DTYPES = "float32, bfloat16 or float16"
# numaov::kOneshot16Divisor: 16-bit all_reduces run one-shot up to oneshot_bytes / this.
_ONESHOT_16_DIVISOR = 16


@functools.cache
def _native() -> ModuleType:
    """The binding, with its C++ CollectiveError mapped to ours (once per process)."""
    module = native_module()
    module.set_collective_error_type(CollectiveError)
    return module


def _is_tensor(t: Any) -> bool:
    # torch is only looked at if something already imported it: a tensor cannot exist otherwise,
    # and numpy-only users do not pay for importing torch.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(t, torch.Tensor)


def _buffer(t: Any, what: str, writable: bool) -> tuple[int, int, int]:
    """(address, element count, dtype code) of a contiguous CPU array or tensor."""
    if isinstance(t, np.ndarray):
        code = _NUMPY_CODES.get(t.dtype.name)
        if code is None:
            raise CollectiveError(f"{what} has dtype {t.dtype}; expected {_EXPECTED_DTYPES}")
        if not t.flags.c_contiguous:
            raise CollectiveError(f"{what} is not C-contiguous; expected a contiguous array")
        if writable and not t.flags.writeable:
            raise CollectiveError(f"{what} is read-only; expected a writeable array")
        return t.ctypes.data, t.size, code
    if _is_tensor(t):
        # This is the per-call path of small collectives: cheap attribute reads only.
        if not _TORCH_CODES:
            import torch

            _TORCH_CODES.update({torch.float32: _F32, torch.bfloat16: _BF16, torch.float16: _F16})
        code = _TORCH_CODES.get(t.dtype)
        if code is None:
            raise CollectiveError(f"{what} has dtype {t.dtype}; expected {_EXPECTED_DTYPES}")
        if not t.is_cpu:
            raise CollectiveError(f"{what} is on {t.device}; expected a CPU tensor")
        if not t.is_contiguous():
            raise CollectiveError(f"{what} is not contiguous; expected a contiguous tensor")
        return t.data_ptr(), t.numel(), code
    raise CollectiveError(
        f"{what} is a {type(t).__name__}; expected a numpy array or a CPU torch tensor"
    )


def _check_pair(op: str, out: tuple[int, int, int], inp: tuple[int, int, int],
                out_factor: int, in_factor: int) -> None:
    """Output and input agree in dtype, and out_factor * len(out) == in_factor * len(inp)."""
    if out[2] != inp[2]:
        raise CollectiveError(f"{op}: output and input dtypes differ; expected the same dtype")
    if out[1] * out_factor != inp[1] * in_factor:
        expected = ("output world_size times the input" if in_factor > out_factor else
                    "input world_size times the output" if out_factor > in_factor else
                    "same number in both")
        raise CollectiveError(
            f"{op}: output has {out[1]} elements and input {inp[1]}; expected the {expected}"
        )


def _check_blocks(op: str, t: Any, what: str, world_size: int) -> None:
    """`t`'s dim 0 splits into world_size equal blocks (torch's all_to_all_single with equal
    splits); uneven splits are not supported."""
    if t.ndim == 0:
        raise CollectiveError(f"{op}: {what} is a scalar; expected at least one dimension "
                              "(dim 0 is split across ranks)")
    if t.shape[0] % world_size != 0:
        raise CollectiveError(f"{op}: {what} dim 0 is {t.shape[0]}; expected a multiple of "
                              f"world_size {world_size} (equal splits only)")


def _check_all_to_all(out: Any, inp: Any, o: tuple[int, int, int], i: tuple[int, int, int],
                      world_size: int) -> None:
    """What every transport's all_to_all asks of its buffers, checked before any data moves."""
    _check_pair("all_to_all", o, i, 1, 1)
    _check_blocks("all_to_all", inp, "input", world_size)
    _check_blocks("all_to_all", out, "output", world_size)


class Communicator(ABC):
    """What every transport offers; all methods are collective (every rank calls them)."""

    group: str
    rank: int
    world_size: int
    #: The C++ communicator numaov's C++ collectives (OpenVINO's ops) run on, or None for a
    #: transport they cannot run.
    _native_comm: Any = None

    @abstractmethod
    def all_reduce(self, t: Any) -> None:
        """In place: `t` becomes the element-wise sum of every rank's `t`."""

    @abstractmethod
    def all_gather_into_tensor(self, out: Any, inp: Any) -> None:
        """`out` (world_size x inp's elements) receives every rank's `inp` in rank order."""

    @abstractmethod
    def reduce_scatter_tensor(self, out: Any, inp: Any) -> None:
        """`out` = sum over ranks of block `rank` of `inp` (world_size x out's elements)."""

    @abstractmethod
    def all_to_all(self, out: Any, inp: Any) -> None:
        """torch's ``all_to_all_single(out, inp)`` with equal splits: `inp`'s dim 0 is split
        into world_size equal blocks, block j going to rank j; block i of `out` (as many
        elements as `inp`, dim 0 also a multiple of world_size) comes from rank i. Uneven
        splits are not supported. `out` may be `inp` itself (in place)."""

    @abstractmethod
    def broadcast(self, t: Any, root: int) -> None:
        """In place: every rank's `t` becomes rank `root`'s."""

    @abstractmethod
    def barrier(self) -> None:
        """Returns once every rank has called it."""

    @abstractmethod
    def close(self) -> None:
        """Releases the transport; the group name then reads as destroyed."""

    @abstractmethod
    def fail(self, reason: str) -> None:
        """For an error found before this rank's collective call: the group is failed, so peers
        already waiting stop instead of waiting out the timeout, and this communicator refuses
        further calls."""

    def all_gather(self, t: Any, dim: int = 0) -> Any:
        """A new array/tensor: every rank's `t` concatenated along `dim` in rank order."""
        ndim = t.ndim
        if ndim == 0:
            raise CollectiveError("all_gather: got a scalar; expected at least one dimension")
        if not -ndim <= dim < ndim:
            raise CollectiveError(f"all_gather: dim {dim} for a {ndim}-d input; expected "
                                  f"{-ndim} <= dim < {ndim}")
        dim %= ndim
        # Gather into [world_size, *shape] (one collective), then lay the blocks out along dim.
        if _is_tensor(t):
            stacked = t.new_empty((self.world_size, *t.shape))
            self.all_gather_into_tensor(stacked, t)
            import torch

            return torch.cat(stacked.unbind(0), dim=dim)
        stacked = np.empty((self.world_size, *t.shape), dtype=t.dtype)
        self.all_gather_into_tensor(stacked, t)
        return np.concatenate(list(stacked), axis=dim)


class ShmCommunicator(Communicator):
    """The shared-memory communicator of one rank of `group`.

    Creating it blocks until all `world_size` ranks have created theirs (bounded by the
    timeout), then registers it under `group`. ``job_id`` defaults to ``$NUMAOV_JOB_ID``, else
    the session id; ``timeout_s`` to ``$NUMAOV_COLL_TIMEOUT_S``, else 60.
    """

    def __init__(self, group: str, rank: int, world_size: int, job_id: str | None = None,
                 timeout_s: float | None = None) -> None:
        if not isinstance(group, str) or not group:
            raise CollectiveError(f"group is {group!r}; expected a non-empty string")
        if timeout_s is not None and not timeout_s > 0:
            raise CollectiveError(f"timeout_s is {timeout_s!r}; expected a positive number")
        self.group = group
        self.rank = int(rank)
        self.world_size = int(world_size)
        # Joins, then registers this object as the group's communicator.
        self._comm = _native().create_communicator(
            group, self.rank, self.world_size, job_id or "",
            float(timeout_s) if timeout_s is not None else -1.0, frontend=self,
        )
        for note in self._comm.notes:
            logger.warning("collective group %r: %s", group, note)
        if self._comm.isa != "avx512":
            logger.info("collective group %r sums with %s kernels: this CPU lacks AVX-512 "
                        "(F, BW, VL)", group, self._comm.isa)
        logger.debug("collective group %r: rank %d/%d on %s (%s kernels)", group, self.rank,
                     self.world_size, self._comm.segment_name, self._comm.isa)

    @property
    def _native_comm(self) -> Any:
        return self._comm

    @property
    def job_id(self) -> str:
        return self._comm.job_id

    @property
    def segment_name(self) -> str:
        """The /dev/shm name (leading '/') the group's segment had; unlinked once all attached."""
        return self._comm.segment_name

    @property
    def timeout_s(self) -> float:
        return self._comm.timeout_s

    @property
    def seq(self) -> int:
        """Collectives issued so far on this communicator."""
        return self._comm.seq

    def algorithm_limits(self, dtype: str) -> dict[str, int]:
        """Element counts where the algorithms change, for dtype "float32", "bfloat16" or
        "float16": all_reduce is one-shot up to ``oneshot_elements`` and reduce-scatter +
        all-gather above; every op moves data in chunks of ``<op>_chunk`` elements, one
        synchronisation each."""
        code = _NUMPY_CODES.get(dtype)
        if code is None:
            raise CollectiveError(f"dtype {dtype!r}; expected {_EXPECTED_DTYPES}")
        # The 16-bit limit is the f32 one over kOneshot16Divisor (csrc/communicator/shm_communicator.hpp).
        oneshot_bytes = self._comm.oneshot_bytes // (1 if code == _F32 else _ONESHOT_16_DIVISOR)
        limits = {"oneshot_elements": oneshot_bytes // (4 if code == _F32 else 2)}
        for op in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all",
                   "broadcast"):
            limits[f"{op}_chunk"] = self._comm.chunk_elements(op, code)
        return limits

    def _buffer(self, t: Any, what: str, writable: bool) -> tuple[int, int, int]:
        try:
            return _buffer(t, what, writable)
        except CollectiveError as exc:
            # The other ranks are already waiting for this call: tell them to stop.
            self.fail(str(exc))
            raise

    def _refuse(self, message: str) -> NoReturn:
        self.fail(message)
        raise CollectiveError(message)

    def fail(self, reason: str) -> None:
        self._comm.fail(reason)

    def all_reduce(self, t: Any) -> None:
        address, count, code = self._buffer(t, "all_reduce tensor", writable=True)
        self._comm.all_reduce(address, count, code)

    def all_gather_into_tensor(self, out: Any, inp: Any) -> None:
        o = self._buffer(out, "all_gather_into_tensor output", writable=True)
        i = self._buffer(inp, "all_gather_into_tensor input", writable=False)
        try:
            _check_pair("all_gather_into_tensor", o, i, 1, self.world_size)
        except CollectiveError as exc:
            self._refuse(str(exc))
        self._comm.all_gather_into_tensor(o[0], i[0], i[1], i[2])

    def reduce_scatter_tensor(self, out: Any, inp: Any) -> None:
        o = self._buffer(out, "reduce_scatter_tensor output", writable=True)
        i = self._buffer(inp, "reduce_scatter_tensor input", writable=False)
        try:
            _check_pair("reduce_scatter_tensor", o, i, self.world_size, 1)
        except CollectiveError as exc:
            self._refuse(str(exc))
        self._comm.reduce_scatter_tensor(o[0], i[0], o[1], o[2])

    def all_to_all(self, out: Any, inp: Any) -> None:
        o = self._buffer(out, "all_to_all output", writable=True)
        i = self._buffer(inp, "all_to_all input", writable=False)
        try:
            _check_all_to_all(out, inp, o, i, self.world_size)
        except CollectiveError as exc:
            self._refuse(str(exc))
        self._comm.all_to_all(o[0], i[0], i[1] // self.world_size, i[2])

    def broadcast(self, t: Any, root: int) -> None:
        address, count, code = self._buffer(t, "broadcast tensor", writable=True)
        self._comm.broadcast(address, count, code, int(root))

    def barrier(self) -> None:
        self._comm.barrier()

    def close(self) -> None:
        """Local: unmaps the segment and marks the group name destroyed."""
        self._comm.close()


class GlooCommunicator(Communicator):
    """``torch.distributed`` collectives over an existing (gloo) process group."""

    def __init__(self, group: str, process_group: Any) -> None:
        import torch.distributed as dist

        self._dist = dist
        self._pg = process_group
        self.group = group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self._closed = False
        self._failure = ""
        register_communicator(self)

    def _check_live(self) -> None:
        if self._closed:
            raise CollectiveError(f"the communicator of group {self.group!r} was destroyed "
                                  "(closed); expected a live communicator")
        if self._failure:
            raise CollectiveError(f"the communicator of group {self.group!r} failed earlier "
                                  f"({self._failure}); expected a new communicator after a "
                                  "failure")

    def _tensor(self, t: Any, what: str, writable: bool) -> Any:
        return self._checked(t, what, writable)[0]

    def _checked(self, t: Any, what: str, writable: bool) -> tuple[Any, tuple[int, int, int]]:
        """`t` as a torch tensor, and _buffer's (address, elements, dtype code) of it."""
        self._check_live()
        buffer = _buffer(t, what, writable)  # the shared-memory transport's checks and messages
        if isinstance(t, np.ndarray):
            # shares memory: in-place results land in `t`; bf16 (ml_dtypes') included, which
            # torch.from_numpy refuses
            t = to_torch(t)
        return t, buffer

    def all_reduce(self, t: Any) -> None:
        self._dist.all_reduce(self._tensor(t, "all_reduce tensor", True), group=self._pg)

    def all_gather_into_tensor(self, out: Any, inp: Any) -> None:
        o = self._tensor(out, "all_gather_into_tensor output", True)
        i = self._tensor(inp, "all_gather_into_tensor input", False)
        self._dist.all_gather_single(o.view(-1), i.reshape(-1), group=self._pg)

    def reduce_scatter_tensor(self, out: Any, inp: Any) -> None:
        o = self._tensor(out, "reduce_scatter_tensor output", True)
        i = self._tensor(inp, "reduce_scatter_tensor input", False)
        self._dist.reduce_scatter_single(o.view(-1), i.reshape(-1), group=self._pg)

    def all_to_all(self, out: Any, inp: Any) -> None:
        o, o_buffer = self._checked(out, "all_to_all output", True)
        i, i_buffer = self._checked(inp, "all_to_all input", False)
        _check_all_to_all(o, i, o_buffer, i_buffer, self.world_size)
        if o_buffer[0] == i_buffer[0]:
            i = i.clone()  # gloo's all_to_all_single reads blocks it has already overwritten
        self._dist.all_to_all_single(o.view(-1), i.reshape(-1), group=self._pg)

    def broadcast(self, t: Any, root: int) -> None:
        tensor = self._tensor(t, "broadcast tensor", True)
        self._dist.broadcast(tensor, src=self._dist.get_global_rank(self._pg, root),
                             group=self._pg)

    def barrier(self) -> None:
        self._check_live()
        self._dist.barrier(group=self._pg)

    def close(self) -> None:
        """Forgets the group; the process group itself belongs to its creator."""
        self._closed = True
        _native().forget_communicator(self.group, self)

    def fail(self, reason: str) -> None:
        """Local only: torch.distributed has no way to stop peers already inside a collective,
        so they raise at gloo's own timeout; this communicator refuses further calls."""
        if not self._failure:
            self._failure = f"rank {self.rank} of group {self.group!r} failed: {reason}"


def shm_bytes_needed(world_size: int) -> int | None:
    """Bytes of /dev/shm a `world_size`-rank group takes (with ``$NUMAOV_COLL_BUFFER_BYTES``),
    or None when the native library is not available to say."""
    from numaov.native import NativeLibraryError

    try:
        return int(_native().segment_bytes(int(world_size)))
    except NativeLibraryError:
        return None


def reclaim_stale_segment(group: str, job_id: str) -> bool:
    """Unlink the /dev/shm segment of `group` under `job_id` if it is still there and its
    creator is gone; True when one was. For a launcher once every rank it started has exited:
    the segment is unlinked as soon as all ranks attached, so one left means a rank died or
    was stopped before the group formed."""
    return bool(_native().reclaim_stale_segment(group, job_id))


# ---------------------------------------------------------------------------------------------
# Registry: group name -> communicator, for ops that only carry a group name. It is the C++
# registry (csrc/communicator/communicator.hpp), shared with OpenVINO's collective ops; nothing is kept here.
# ---------------------------------------------------------------------------------------------


def register_communicator(comm: Communicator) -> None:
    """Make `comm` the communicator of its group (creating one already does this); registering
    the same one again is a no-op, another one under a taken name is refused."""
    _native().register_communicator(comm.group, comm, type(comm).__name__, comm._native_comm)


def find_communicator(group: str) -> Communicator:
    """The communicator of `group`; CollectiveError says "not found" or "destroyed"."""
    return _native().find_frontend(group)


def destroy_communicator(group: str) -> None:
    """Close the communicator of `group`; its name then reads as destroyed. Idempotent."""
    comm = _native().destroy_communicator(group)
    if comm is not None:
        comm.close()
