"""Which CPUs and which memory each rank gets, and how a worker applies that.

A `BindingPlan` has one entry per rank. One rule (`BindingPlan.resolve`) decides it for every
command that starts workers:

1. ``NUMAOV_CPU_BIND`` set: one CPU list per rank, separated by ``|`` (``"0-27|28-55"``,
   ``"0-3,8-11|4-7,12-15"``). Each entry is checked first (a CPU id or range, on this machine,
   allowed to this process, in no other entry), then the entry count against the ranks.
2. Otherwise one rank per NUMA node, on that node's physical cores (first hardware thread of
   each core) that this process may use.
3. Fewer usable NUMA nodes than ranks: the allowed CPUs are split into one contiguous block per
   rank, and `plan_for_ranks` logs a warning saying so.

Applying a rank's binding inside its worker process restricts the process to
its CPUs, binds memory allocation to the NUMA nodes of those CPUs (moving
pages already allocated) so weights and KV cache sit in local memory, and
gives the thread count for OpenVINO: one inference thread per core.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

from numaov import NumaovError
from numaov.runtime.placement.topology import (
    Topology,
    TopologyError,
    format_cpu_list,
    parse_cpu_list,
    read_topology,
)

log = logging.getLogger(__name__)

BIND_ENV = "NUMAOV_CPU_BIND"
PER_NODE = "default (one rank per NUMA node)"
SPLIT = "default (fewer NUMA nodes than ranks: the allowed CPUs split between the ranks)"


class BindingError(NumaovError):
    """A bind string or a plan does not fit this machine or the ranks asked for."""


class RankCountError(BindingError):
    """A valid bind string with another number of CPU lists than the ranks asked for."""


def bind_string(env: Mapping[str, str] | None = None) -> str:
    """``NUMAOV_CPU_BIND`` from ``env`` (default the process environment); "" when unset."""
    return (os.environ if env is None else env).get(BIND_ENV, "").strip()


@dataclass(frozen=True)
class RankBinding:
    rank: int
    cpus: tuple[int, ...]
    # The NUMA nodes of `cpus`: where this rank's memory is bound.
    nodes: tuple[int, ...]

    @property
    def threads(self) -> int:
        return len(self.cpus)


@dataclass(frozen=True)
class BindingPlan:
    ranks: tuple[RankBinding, ...]
    # BIND_ENV, PER_NODE or SPLIT: which branch of the rule gave the plan.
    source: str

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def rank_cpus(self) -> str:
        """Each rank's CPUs, in one line."""
        return ", ".join(f"rank {b.rank} on CPUs {format_cpu_list(b.cpus)}" for b in self.ranks)

    @property
    def placement(self) -> str:
        """Where the plan came from and each rank's CPUs, in one line."""
        return f"{self.source}: {self.rank_cpus}"

    @classmethod
    def resolve(
        cls, topology: Topology, ranks: int | None = None, env: Mapping[str, str] | None = None
    ) -> BindingPlan:
        """The plan for ``ranks`` ranks (None: as many as the bind string or the NUMA nodes
        give): from ``NUMAOV_CPU_BIND`` when set, else `default`."""
        bind = bind_string(env)
        if bind:
            return cls.from_bind_string(bind, topology, ranks)
        return cls.default(topology, ranks)

    @classmethod
    def default(cls, topology: Topology, ranks: int | None = None) -> BindingPlan:
        """One rank per NUMA node, each on the node's physical cores we may use; with more
        ranks than such nodes, the allowed CPUs split between the ranks."""
        usable = topology.usable_nodes()
        if not usable:
            raise BindingError(
                f"no NUMA node has a physical core this process may use (allowed CPUs: "
                f"{format_cpu_list(topology.allowed_cpus)}); expected at least one"
            )
        if ranks is None:
            ranks = len(usable)
        if ranks < 1:
            raise BindingError(f"{ranks} ranks asked for; expected at least 1")
        if ranks > len(usable):
            return cls._split_allowed_cpus(topology, ranks)
        return cls(
            tuple(RankBinding(r, cores, (node.id,)) for r, (node, cores) in enumerate(usable[:ranks])),
            PER_NODE,
        )

    @classmethod
    def _split_allowed_cpus(cls, topology: Topology, ranks: int) -> BindingPlan:
        """The allowed CPUs split into `ranks` contiguous blocks, one per rank.

        Physical cores first; CPUs are shared only when there are fewer CPUs than ranks.
        Contiguous rather than dealt out one by one, so that on a machine with a few NUMA
        nodes a rank's CPUs stay on one node when the counts divide.
        """
        cores = sorted({c for _, node_cores in topology.usable_nodes() for c in node_cores})
        cpus = cores if len(cores) >= ranks else sorted(topology.allowed_cpus)
        n = len(cpus)
        bindings = []
        for rank in range(ranks):
            mine = tuple(cpus[rank * n // ranks:(rank + 1) * n // ranks]) or (cpus[rank % n],)
            bindings.append(RankBinding(rank, mine, _nodes_of(topology, mine)))
        return cls(tuple(bindings), SPLIT)

    @classmethod
    def from_bind_string(
        cls, bind: str, topology: Topology, ranks: int | None = None
    ) -> BindingPlan:
        """The plan a bind string gives; every entry is checked before the entry count."""
        entries = bind.split("|")
        online, allowed = set(topology.online_cpus), set(topology.allowed_cpus)
        owner: dict[int, int] = {}
        bindings: list[RankBinding] = []
        for rank, entry in enumerate(entries):
            what = f"{BIND_ENV} entry {rank} ({entry.strip()!r})"
            if not entry.strip():
                raise BindingError(f"{what} is empty; expected a CPU list such as '0-3'")
            try:
                cpus = parse_cpu_list(entry, what)
            except TopologyError as exc:
                raise BindingError(str(exc)) from None
            for cpu in cpus:
                if cpu not in online:
                    raise BindingError(
                        f"{what}: CPU {cpu} is not an online CPU of this machine; expected CPUs "
                        f"from {format_cpu_list(topology.online_cpus)}"
                    )
                if cpu not in allowed:
                    raise BindingError(
                        f"{what}: CPU {cpu} is outside this process's allowed CPUs (e.g. a "
                        f"container limit); expected CPUs from "
                        f"{format_cpu_list(topology.allowed_cpus)}"
                    )
                if cpu in owner:
                    raise BindingError(
                        f"{what}: CPU {cpu} is already in entry {owner[cpu]}; expected each CPU "
                        "in at most one rank"
                    )
                owner[cpu] = rank
            bindings.append(RankBinding(rank, cpus, _nodes_of(topology, cpus)))
        if ranks is not None and len(entries) != ranks:
            raise RankCountError(
                f"{BIND_ENV}={bind!r} has {len(entries)} CPU list(s) but {ranks} rank(s) were "
                "asked for; expected one CPU list per rank, separated by '|'"
            )
        return cls(tuple(bindings), BIND_ENV)

    def warnings(self, topology: Topology) -> list[str]:
        """Things a user should act on; the plan itself is valid."""
        out: list[str] = []
        for binding in self.ranks:
            smt = [
                c for c in binding.cpus
                if any(s != c and s in binding.cpus for s in topology.core_siblings.get(c, (c,)))
                and c != min(topology.core_siblings.get(c, (c,)))
            ]
            if smt:
                out.append(
                    f"rank {binding.rank} has SMT siblings of its own cores ({format_cpu_list(smt)}): "
                    "two inference threads then share one core's matmul units; list only the "
                    "first hardware thread of each core"
                )
            if len(binding.nodes) > 1:
                out.append(
                    f"rank {binding.rank} spans NUMA nodes {list(binding.nodes)}: its memory is "
                    "interleaved over them and half its accesses are remote"
                )
        return out

    def describe(self) -> list[dict]:
        return [
            {"rank": b.rank, "cpus": format_cpu_list(b.cpus), "nodes": list(b.nodes),
             "threads": b.threads}
            for b in self.ranks
        ]


def _nodes_of(topology: Topology, cpus: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(sorted({n for n in map(topology.node_of, cpus) if n is not None}))


_warned_splits: set[str] = set()
_warned_unpinned: set[tuple[str, str]] = set()


def plan_for_ranks(
    ranks: int, env: Mapping[str, str] | None = None, topology: Topology | None = None
) -> BindingPlan:
    """The plan of a command that starts ``ranks`` workers (`BindingPlan.resolve` on this
    machine); a warning in the log when the allowed CPUs are split between the ranks, once
    per process and split (a demo or a service plans the same ranks many times)."""
    topology = read_topology() if topology is None else topology
    plan = BindingPlan.resolve(topology, ranks, env)
    if plan.source == SPLIT and plan.rank_cpus not in _warned_splits:
        _warned_splits.add(plan.rank_cpus)
        log.warning(
            "%d rank(s) but %d usable NUMA node(s): the allowed CPUs are split between the "
            "ranks (%s); set %s to choose the CPUs", ranks, len(topology.usable_nodes()),
            plan.rank_cpus, BIND_ENV,
        )
    return plan


def check_bind_string(what: str, env: Mapping[str, str] | None = None) -> None:
    """For work that runs in this process rather than in pinned workers: a set
    ``NUMAOV_CPU_BIND`` is still checked (an error names its bad entry), and a warning says
    that it does not apply to ``what``."""
    bind = bind_string(env)
    if not bind:
        return
    BindingPlan.from_bind_string(bind, read_topology())
    # Once per process and kind of work: a server or the demo runs the same work many times.
    if (what, bind) not in _warned_unpinned:
        _warned_unpinned.add((what, bind))
        log.warning("%s runs in this process, which is not pinned: %s=%r applies to worker "
                    "processes only", what, BIND_ENV, bind)


@dataclass(frozen=True)
class AppliedBinding:
    rank: int
    cpus: tuple[int, ...]
    threads: int
    # How memory was bound, in plain words (or why it was not).
    memory: str

    def openvino_config(self) -> dict[str, object]:
        """Compile properties that put one pinned inference thread on each core."""
        return {"INFERENCE_NUM_THREADS": self.threads, "ENABLE_CPU_PINNING": True,
                "NUM_STREAMS": 1}


def apply_rank_binding(plan: BindingPlan, rank: int) -> AppliedBinding:
    """Bind the calling process to rank `rank` of `plan`. Call it in the worker."""
    if not 0 <= rank < plan.world_size:
        raise BindingError(f"rank {rank} is not in the plan; expected 0..{plan.world_size - 1}")
    binding = plan.ranks[rank]
    try:
        os.sched_setaffinity(0, binding.cpus)
    except OSError as exc:
        raise BindingError(
            f"cannot restrict rank {rank} to CPUs {format_cpu_list(binding.cpus)}: {exc}"
        ) from None
    memory = _bind_memory(binding.nodes)
    log.info("rank %d bound to CPUs %s; %s", rank, format_cpu_list(binding.cpus), memory)
    return AppliedBinding(rank, binding.cpus, binding.threads, memory)


def _bind_memory(nodes: tuple[int, ...]) -> str:
    """Bind future allocations to `nodes` and move pages already allocated."""
    if not nodes:
        return "memory not bound: the CPUs' NUMA node is unknown"
    libnuma = _libnuma()
    if libnuma is None:
        return "memory not bound: libnuma (libnuma.so.1) is not installed; pages follow first touch"
    if libnuma.numa_available() < 0:
        return "memory not bound: the kernel reports no NUMA support"
    node_string = ",".join(map(str, nodes)).encode()
    mask = libnuma.numa_parse_nodestring(node_string)
    if not mask:
        return f"memory not bound: libnuma rejected node list {node_string.decode()}"
    try:
        libnuma.numa_set_membind(mask)
        all_nodes = ctypes.c_void_p.in_dll(libnuma, "numa_all_nodes_ptr")
        moved = libnuma.numa_migrate_pages(0, all_nodes, mask)
    finally:
        libnuma.numa_bitmask_free(mask)
    note = "" if moved >= 0 else " (moving existing pages failed; new pages are still local)"
    return f"memory bound to NUMA node(s) {node_string.decode()} with libnuma{note}"


def _libnuma() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("numa") or "libnuma.so.1"
    try:
        lib = ctypes.CDLL(name)
    except OSError:
        return None
    lib.numa_available.restype = ctypes.c_int
    lib.numa_parse_nodestring.restype = ctypes.c_void_p
    lib.numa_parse_nodestring.argtypes = [ctypes.c_char_p]
    lib.numa_set_membind.argtypes = [ctypes.c_void_p]
    lib.numa_migrate_pages.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    lib.numa_migrate_pages.restype = ctypes.c_int
    lib.numa_bitmask_free.argtypes = [ctypes.c_void_p]
    return lib


def memory_bind_nodes() -> tuple[int, ...] | None:
    """The nodes the calling process's memory is bound to (None without libnuma)."""
    libnuma = _libnuma()
    if libnuma is None or libnuma.numa_available() < 0:
        return None
    libnuma.numa_get_membind.restype = ctypes.c_void_p
    libnuma.numa_bitmask_isbitset.argtypes = [ctypes.c_void_p, ctypes.c_uint]
    libnuma.numa_max_node.restype = ctypes.c_int
    mask = libnuma.numa_get_membind()
    try:
        return tuple(n for n in range(libnuma.numa_max_node() + 1)
                     if libnuma.numa_bitmask_isbitset(mask, n))
    finally:
        libnuma.numa_bitmask_free(mask)
