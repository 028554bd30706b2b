"""Which CPUs and which memory each rank gets, and how a worker applies that.

A `BindingPlan` has one entry per rank. It comes from the bind string in
``NUMAOV_CPU_BIND`` (one CPU list per rank, separated by ``|``:
``"0-27|28-55"``, ``"0-3,8-11|4-7,12-15"``) or, by default, one rank per NUMA
node on that node's physical cores (first hardware thread of each core)
that this process may use.

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
from numaov.runtime.topology import Topology, TopologyError, format_cpu_list, parse_cpu_list

log = logging.getLogger(__name__)

BIND_ENV = "NUMAOV_CPU_BIND"


class BindingError(NumaovError):
    """A bind string or a plan does not fit this machine or the ranks asked for."""


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
    # "NUMAOV_CPU_BIND" or "default (one rank per NUMA node)".
    source: str

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @classmethod
    def resolve(
        cls, topology: Topology, ranks: int | None = None, env: Mapping[str, str] | None = None
    ) -> BindingPlan:
        """The plan to use: from ``NUMAOV_CPU_BIND`` when set, else the default."""
        env = os.environ if env is None else env
        bind = env.get(BIND_ENV, "").strip()
        if bind:
            return cls.from_bind_string(bind, topology, ranks)
        return cls.default(topology, ranks)

    @classmethod
    def default(cls, topology: Topology, ranks: int | None = None) -> BindingPlan:
        """One rank per NUMA node, each on the node's physical cores we may use."""
        usable = [(node, topology.usable_cores(node)) for node in topology.nodes]
        usable = [(node, cores) for node, cores in usable if cores]
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
            raise BindingError(
                f"{ranks} ranks asked for but this machine has {len(usable)} usable NUMA "
                f"node(s) ({', '.join(str(n.id) for n, _ in usable)}); by default each rank gets "
                f"its own node. Ask for at most {len(usable)} rank(s), or set {BIND_ENV} with one "
                "CPU list per rank, e.g. NUMAOV_CPU_BIND='0|1'"
            )
        return cls(
            tuple(RankBinding(r, cores, (node.id,)) for r, (node, cores) in enumerate(usable[:ranks])),
            "default (one rank per NUMA node)",
        )

    @classmethod
    def split_allowed_cpus(cls, topology: Topology, ranks: int) -> BindingPlan:
        """The allowed CPUs split into `ranks` contiguous blocks, one per rank.

        For running more ranks than NUMA nodes without a bind string (the demo, benchmarks
        on a small machine): physical cores first; CPUs are shared only
        when there are fewer CPUs than ranks. Contiguous rather than dealt out one by one, so
        that on a machine with a few NUMA nodes a rank's CPUs stay on one node when the
        counts divide.
        """
        cores = sorted({c for node in topology.nodes for c in topology.usable_cores(node)})
        cpus = cores if len(cores) >= ranks else sorted(topology.allowed_cpus)
        n = len(cpus)
        bindings = []
        for rank in range(ranks):
            mine = tuple(cpus[rank * n // ranks:(rank + 1) * n // ranks]) or (cpus[rank % n],)
            nodes = tuple(sorted({node for node in map(topology.node_of, mine) if node is not None}))
            bindings.append(RankBinding(rank, mine, nodes))
        return cls(tuple(bindings), "allowed CPUs split between the ranks")

    @classmethod
    def from_bind_string(
        cls, bind: str, topology: Topology, ranks: int | None = None
    ) -> BindingPlan:
        entries = bind.split("|")
        if ranks is not None and len(entries) != ranks:
            raise BindingError(
                f"{BIND_ENV}={bind!r} has {len(entries)} CPU list(s) but {ranks} rank(s) were "
                "asked for; expected one CPU list per rank, separated by '|'"
            )
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
                        f"{what}: CPU {cpu} is unknown or offline; this machine's online CPUs "
                        f"are {format_cpu_list(topology.online_cpus)}"
                    )
                if cpu not in allowed:
                    raise BindingError(
                        f"{what}: CPU {cpu} is outside this process's allowed CPUs "
                        f"({format_cpu_list(topology.allowed_cpus)}), e.g. a container limit"
                    )
                if cpu in owner:
                    raise BindingError(
                        f"{what}: CPU {cpu} is already in entry {owner[cpu]}; expected each CPU "
                        "in at most one rank"
                    )
                owner[cpu] = rank
            nodes = tuple(sorted({n for n in map(topology.node_of, cpus) if n is not None}))
            bindings.append(RankBinding(rank, cpus, nodes))
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
