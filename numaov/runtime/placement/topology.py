"""What this machine is: NUMA nodes, cores, the CPUs we may use, ISA, /dev/shm.

Everything is read from sysfs and procfs (paths are parameters so tests can
point at fake trees). Containers often hide parts of sysfs; where a file is
missing we fall back to a stated assumption, recorded in
`Topology.assumptions`, and never crash.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from numaov import NumaovError

log = logging.getLogger(__name__)


class TopologyError(NumaovError):
    """A CPU list could not be parsed."""


def parse_cpu_list(text: str, what: str = "CPU list") -> tuple[int, ...]:
    """Parse a Linux CPU list such as ``"0-3,8-11"`` into sorted CPU ids.

    `what` names the list in the error message (e.g. ``"entry 2 of NUMAOV_CPU_BIND"``).
    """
    cpus: set[int] = set()
    text = text.strip()
    if not text:
        return ()
    for part in text.split(","):
        part = part.strip()
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not match:
            raise TopologyError(
                f"{what}: {part!r} is not a CPU id or a range of them; expected CPU ids and "
                "ranges such as '0-3,8-11'"
            )
        first = int(match.group(1))
        last = int(match.group(2)) if match.group(2) is not None else first
        if last < first:
            raise TopologyError(
                f"{what}: range {part!r} runs backwards; expected 'low-high' such as '0-3'"
            )
        cpus.update(range(first, last + 1))
    return tuple(sorted(cpus))


def format_cpu_list(cpus: tuple[int, ...] | frozenset[int] | list[int]) -> str:
    """The inverse of `parse_cpu_list`: ``(0, 1, 2, 5)`` -> ``"0-2,5"``."""
    ordered = sorted(cpus)
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


@dataclass(frozen=True)
class NumaNode:
    """One NUMA node: its online CPUs, its physical cores and its memory."""

    id: int
    cpus: tuple[int, ...]
    # First hardware thread of each core on this node (online CPUs only).
    physical_cores: tuple[int, ...]
    memory_bytes: int | None


@dataclass(frozen=True)
class IsaFlags:
    """The instruction-set features that change how OpenVINO runs matmuls.

    AMX (tile matrix units, Sapphire Rapids and later) runs bf16/int8 matmuls
    several times faster than AVX-512; AVX512-BF16 gives bf16 dot products
    without AMX. OpenVINO's CPU plugin picks bf16 inference precision by
    default on either. `amx_usable` also requires the kernel to grant the
    tile-data state to this process (Linux 5.16+).
    """

    avx2: bool = False
    avx512f: bool = False
    avx512_bf16: bool = False
    avx512_fp16: bool = False
    avx512_vnni: bool = False
    amx_bf16: bool = False
    amx_int8: bool = False
    amx_tile: bool = False
    amx_usable: bool = False

    def as_dict(self) -> dict[str, bool]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class ShmSpace:
    path: str
    total_bytes: int | None
    free_bytes: int | None


@dataclass(frozen=True)
class Topology:
    nodes: tuple[NumaNode, ...]
    online_cpus: tuple[int, ...]
    # The CPUs this process may run on (its affinity mask).
    allowed_cpus: tuple[int, ...]
    # cpu -> the CPUs sharing its core (itself included).
    core_siblings: dict[int, tuple[int, ...]]
    isa: IsaFlags
    shm: ShmSpace
    # Fallbacks taken because sysfs was incomplete, each a plain sentence.
    assumptions: tuple[str, ...] = field(default_factory=tuple)

    @property
    def physical_cores(self) -> tuple[int, ...]:
        return tuple(sorted(c for node in self.nodes for c in node.physical_cores))

    def node_of(self, cpu: int) -> int | None:
        for node in self.nodes:
            if cpu in node.cpus:
                return node.id
        return None

    def usable_cores(self, node: NumaNode) -> tuple[int, ...]:
        """A node's default CPU list: its physical cores we are allowed to use."""
        allowed = set(self.allowed_cpus)
        return tuple(c for c in node.physical_cores if c in allowed)

    def usable_nodes(self) -> list[tuple[NumaNode, tuple[int, ...]]]:
        """The nodes with a physical core we may use, each with those cores."""
        usable = [(node, self.usable_cores(node)) for node in self.nodes]
        return [(node, cores) for node, cores in usable if cores]


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _node_memory(node_dir: Path) -> int | None:
    text = _read(node_dir / "meminfo")
    if text is None:
        return None
    match = re.search(r"MemTotal:\s+(\d+)\s*kB", text)
    return int(match.group(1)) * 1024 if match else None


def _read_isa(proc_root: Path) -> IsaFlags:
    text = _read(proc_root / "cpuinfo") or ""
    match = re.search(r"^flags\s*:\s*(.*)$", text, re.MULTILINE)
    flags = set(match.group(1).split()) if match else set()
    amx_tile = "amx_tile" in flags
    return IsaFlags(
        avx2="avx2" in flags,
        avx512f="avx512f" in flags,
        avx512_bf16="avx512_bf16" in flags,
        avx512_fp16="avx512_fp16" in flags,
        avx512_vnni="avx512_vnni" in flags,
        amx_bf16="amx_bf16" in flags,
        amx_int8="amx_int8" in flags,
        amx_tile=amx_tile,
        amx_usable=amx_tile and _kernel_grants_amx(),
    )


def _kernel_grants_amx() -> bool:
    """Ask Linux whether it supports the AMX tile-data state for processes.

    arch_prctl(ARCH_GET_XCOMP_SUPP) returns the bitmask of extended states the
    kernel manages; bit 18 is XTILEDATA. A VM or an old kernel may report the
    CPU flag yet not support the state, and then AMX instructions fault.
    """
    if platform.machine() != "x86_64":
        return False
    sys_arch_prctl, arch_get_xcomp_supp, xfeature_xtiledata = 158, 0x1021, 18
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        mask = ctypes.c_uint64(0)
        if libc.syscall(sys_arch_prctl, arch_get_xcomp_supp, ctypes.byref(mask)) != 0:
            return False
        return bool(mask.value >> xfeature_xtiledata & 1)
    except (OSError, AttributeError):
        return False


def read_shm_space(path: str = "/dev/shm") -> ShmSpace:
    try:
        usage = shutil.disk_usage(path)
    except OSError:
        return ShmSpace(path, None, None)
    return ShmSpace(path, usage.total, usage.free)


def read_topology(
    sys_root: str | Path = "/sys",
    proc_root: str | Path = "/proc",
    allowed_cpus: tuple[int, ...] | None = None,
    shm_path: str = "/dev/shm",
) -> Topology:
    """Read the machine's topology; missing sysfs files become stated assumptions."""
    sys_root, proc_root = Path(sys_root), Path(proc_root)
    assumptions: list[str] = []
    cpu_dir = sys_root / "devices/system/cpu"

    if allowed_cpus is None:
        allowed_cpus = tuple(sorted(os.sched_getaffinity(0)))
    allowed = tuple(sorted(allowed_cpus))

    online_text = _read(cpu_dir / "online")
    if online_text is not None:
        online = parse_cpu_list(online_text, f"{cpu_dir / 'online'}")
    else:
        online = allowed
        assumptions.append(
            f"{cpu_dir / 'online'} is missing: assuming the online CPUs are this process's "
            f"allowed CPUs ({format_cpu_list(allowed)})"
        )

    # Core siblings: the first hardware thread of a core is its physical core.
    siblings: dict[int, tuple[int, ...]] = {}
    missing_smt = []
    for cpu in online:
        text = _read(cpu_dir / f"cpu{cpu}/topology/thread_siblings_list")
        if text is None:
            missing_smt.append(cpu)
            siblings[cpu] = (cpu,)
        else:
            siblings[cpu] = tuple(c for c in parse_cpu_list(text) if c in online) or (cpu,)
    if missing_smt:
        assumptions.append(
            f"no thread_siblings_list for CPUs {format_cpu_list(missing_smt)}: treating each "
            "of them as its own physical core (no SMT)"
        )

    def first_threads(cpus: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(c for c in cpus if c == min(siblings[c]))

    node_root = sys_root / "devices/system/node"
    node_dirs = sorted(
        (p for p in node_root.glob("node[0-9]*") if p.name[4:].isdigit()),
        key=lambda p: int(p.name[4:]),
    )
    nodes: list[NumaNode] = []
    for node_dir in node_dirs:
        text = _read(node_dir / "cpulist")
        if text is None:
            assumptions.append(f"{node_dir / 'cpulist'} is missing: node {node_dir.name} skipped")
            continue
        cpus = tuple(c for c in parse_cpu_list(text) if c in online)
        if not cpus:
            continue  # memory-only node (e.g. CXL or HBM without cores)
        nodes.append(NumaNode(int(node_dir.name[4:]), cpus, first_threads(cpus),
                              _node_memory(node_dir)))
    if not nodes:
        assumptions.append(
            f"no NUMA nodes under {node_root}: assuming one node (0) holding every online CPU"
        )
        nodes.append(NumaNode(0, online, first_threads(online), _read_meminfo_total(proc_root)))

    return Topology(
        nodes=tuple(nodes),
        online_cpus=online,
        allowed_cpus=allowed,
        core_siblings=siblings,
        isa=_read_isa(proc_root),
        shm=read_shm_space(shm_path),
        assumptions=tuple(assumptions),
    )


def _read_meminfo_total(proc_root: Path) -> int | None:
    text = _read(proc_root / "meminfo")
    match = re.search(r"MemTotal:\s+(\d+)\s*kB", text or "")
    return int(match.group(1)) * 1024 if match else None
