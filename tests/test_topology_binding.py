"""Topology reading and binding plans against fake sysfs trees, and a real
binding applied in a spawned process."""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path

import pytest

from numaov.runtime.binding import BindingError, BindingPlan, apply_rank_binding, memory_bind_nodes
from numaov.runtime.topology import format_cpu_list, parse_cpu_list, read_topology

CPUINFO = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16\n"


def make_sysfs(root: Path, nodes: dict[int, str], siblings: dict[int, str] | None,
               online: str | None) -> tuple[Path, Path]:
    """Write a fake /sys and /proc: node cpulists, per-CPU thread siblings, online list."""
    sys_root, proc_root = root / "sys", root / "proc"
    cpu_dir = sys_root / "devices/system/cpu"
    cpu_dir.mkdir(parents=True)
    proc_root.mkdir()
    (proc_root / "cpuinfo").write_text(CPUINFO)
    if online is not None:
        (cpu_dir / "online").write_text(online + "\n")
    for node, cpus in nodes.items():
        node_dir = sys_root / f"devices/system/node/node{node}"
        node_dir.mkdir(parents=True)
        (node_dir / "cpulist").write_text(cpus + "\n")
        (node_dir / "meminfo").write_text(f"Node {node} MemTotal:       1048576 kB\n")
    for cpu, sib in (siblings or {}).items():
        topo = cpu_dir / f"cpu{cpu}/topology"
        topo.mkdir(parents=True)
        (topo / "thread_siblings_list").write_text(sib + "\n")
    return sys_root, proc_root


@pytest.fixture
def two_socket_smt(tmp_path: Path):
    """2 sockets x 2 NUMA nodes x 2 cores x 2 threads: CPU c and c+8 share a core."""
    nodes = {0: "0-1,8-9", 1: "2-3,10-11", 2: "4-5,12-13", 3: "6-7,14-15"}
    siblings = {c: f"{c % 8},{c % 8 + 8}" for c in range(16)}
    return make_sysfs(tmp_path, nodes, siblings, "0-15")


def test_cpu_list_round_trip() -> None:
    assert parse_cpu_list("0-3,8-11") == (0, 1, 2, 3, 8, 9, 10, 11)
    assert format_cpu_list((0, 1, 2, 3, 8, 9, 10, 11)) == "0-3,8-11"
    assert parse_cpu_list(" 5 ") == (5,)


def test_two_socket_smt_default_plan(two_socket_smt) -> None:
    sys_root, proc_root = two_socket_smt
    topo = read_topology(sys_root, proc_root, allowed_cpus=tuple(range(16)))
    assert [n.id for n in topo.nodes] == [0, 1, 2, 3]
    assert topo.nodes[1].physical_cores == (2, 3)
    assert topo.nodes[0].memory_bytes == 1024**3
    assert topo.isa.avx512_bf16 and not topo.isa.amx_tile
    assert topo.assumptions == ()
    plan = BindingPlan.resolve(topo, env={})
    assert [b.cpus for b in plan.ranks] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert [b.nodes for b in plan.ranks] == [(0,), (1,), (2,), (3,)]
    assert BindingPlan.default(topo, ranks=2).world_size == 2
    with pytest.raises(BindingError, match="5 ranks asked for but this machine has 4 usable"):
        BindingPlan.default(topo, ranks=5)


def test_bind_string_plans_and_warnings(two_socket_smt) -> None:
    sys_root, proc_root = two_socket_smt
    topo = read_topology(sys_root, proc_root, allowed_cpus=tuple(range(16)))
    plan = BindingPlan.resolve(topo, env={"NUMAOV_CPU_BIND": "0-1,8-9|2-3"})
    assert plan.source == "NUMAOV_CPU_BIND"
    assert [b.cpus for b in plan.ranks] == [(0, 1, 8, 9), (2, 3)]
    warnings = plan.warnings(topo)
    assert any("rank 0 has SMT siblings" in w and "8-9" in w for w in warnings)
    spanning = BindingPlan.from_bind_string("0-3|4-7", topo)
    assert spanning.ranks[0].nodes == (0, 1)
    assert any("spans NUMA nodes" in w for w in spanning.warnings(topo))
    # A bind string may put more ranks than NUMA nodes on the machine.
    assert BindingPlan.from_bind_string("0|1|2|3|4|5", topo).world_size == 6


@pytest.mark.parametrize(
    ("bind", "ranks", "message"),
    [
        ("0-1|1-2", None, "CPU 1 is already in entry 0"),
        ("0-1||2", None, "entry 1 .* is empty"),
        ("0-1|2-3", 3, r"has 2 CPU list\(s\) but 3 rank\(s\) were asked"),
        ("0-1|99", None, "CPU 99 is unknown or offline"),
        ("0-x", None, "cannot parse '0-x'"),
        ("3-1", None, "runs backwards"),
    ],
)
def test_bind_string_errors(two_socket_smt, bind: str, ranks: int | None, message: str) -> None:
    sys_root, proc_root = two_socket_smt
    topo = read_topology(sys_root, proc_root, allowed_cpus=tuple(range(16)))
    with pytest.raises(BindingError, match=message):
        BindingPlan.resolve(topo, ranks, env={"NUMAOV_CPU_BIND": bind})


def test_offline_cpus(tmp_path: Path) -> None:
    sys_root, proc_root = make_sysfs(
        tmp_path, {0: "0-3", 1: "4-7"}, {c: str(c) for c in range(8)}, "0-2,4-7"
    )
    topo = read_topology(sys_root, proc_root, allowed_cpus=tuple(range(8)))
    assert topo.nodes[0].cpus == (0, 1, 2)
    assert 3 not in topo.physical_cores
    with pytest.raises(BindingError, match="CPU 3 is unknown or offline"):
        BindingPlan.from_bind_string("3|4", topo)


def test_container_with_restricted_affinity(two_socket_smt) -> None:
    sys_root, proc_root = two_socket_smt
    topo = read_topology(sys_root, proc_root, allowed_cpus=(2, 3, 10, 11))
    plan = BindingPlan.default(topo)
    assert [b.cpus for b in plan.ranks] == [(2, 3)]
    assert plan.ranks[0].nodes == (1,)
    with pytest.raises(BindingError, match="1 usable NUMA node"):
        BindingPlan.default(topo, ranks=2)
    with pytest.raises(BindingError, match="CPU 0 is outside this process's allowed CPUs"):
        BindingPlan.from_bind_string("0|2", topo)


def test_missing_sysfs_falls_back_with_stated_assumptions(tmp_path: Path) -> None:
    sys_root, proc_root = tmp_path / "sys", tmp_path / "proc"
    sys_root.mkdir()
    proc_root.mkdir()  # no cpuinfo either
    topo = read_topology(sys_root, proc_root, allowed_cpus=(0, 1, 2))
    assert [n.cpus for n in topo.nodes] == [(0, 1, 2)]
    assert topo.physical_cores == (0, 1, 2)
    text = " ".join(topo.assumptions)
    assert "online" in text and "thread_siblings_list" in text and "one node" in text
    assert not topo.isa.avx2
    assert BindingPlan.default(topo).ranks[0].cpus == (0, 1, 2)


def test_missing_siblings_for_some_cpus(tmp_path: Path) -> None:
    sys_root, proc_root = make_sysfs(tmp_path, {0: "0-3"}, {0: "0,2", 2: "0,2"}, "0-3")
    topo = read_topology(sys_root, proc_root, allowed_cpus=(0, 1, 2, 3))
    assert topo.nodes[0].physical_cores == (0, 1, 3)
    assert any("CPUs 1,3" in a for a in topo.assumptions)


def test_real_machine_topology_is_consistent() -> None:
    topo = read_topology()
    assert topo.nodes, "at least one NUMA node"
    assert set(topo.physical_cores) <= set(topo.online_cpus)
    assert set(topo.allowed_cpus) == os.sched_getaffinity(0)


def _apply_in_child(bind: str, rank: int, queue) -> None:
    topo = read_topology()
    plan = BindingPlan.from_bind_string(bind, topo)
    applied = apply_rank_binding(plan, rank)
    queue.put((sorted(os.sched_getaffinity(0)), applied.threads, applied.memory,
               memory_bind_nodes(), applied.openvino_config()))


def test_applying_a_plan_restricts_a_spawned_process(two_cpus) -> None:
    first, second = two_cpus
    bind = f"{first}|{second}"
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_apply_in_child, args=(bind, 1, queue))
    child.start()
    affinity, threads, memory, nodes, config = queue.get(timeout=60)
    child.join(timeout=30)
    assert child.exitcode == 0
    assert affinity == [second]
    assert threads == 1 and config["INFERENCE_NUM_THREADS"] == 1
    node = read_topology().node_of(second)
    if nodes is not None:  # libnuma present: memory really bound to the CPU's node
        assert nodes == (node,), memory
        assert "bound to NUMA node" in memory
    else:
        assert "libnuma" in memory
    # The parent is untouched.
    assert {first, second} <= os.sched_getaffinity(0)


def test_apply_rejects_unknown_rank(two_cpus) -> None:
    plan = BindingPlan.from_bind_string(f"{two_cpus[0]}", read_topology())
    with pytest.raises(BindingError, match="rank 3 is not in the plan"):
        apply_rank_binding(plan, 3)


def test_split_allowed_cpus_keeps_blocks_contiguous(two_socket_smt) -> None:
    sys_root, proc_root = two_socket_smt
    topo = read_topology(sys_root, proc_root, allowed_cpus=tuple(range(16)))
    plan = BindingPlan.split_allowed_cpus(topo, 2)
    # Physical cores 0-7 in two blocks: each rank stays on one socket's two nodes.
    assert [b.cpus for b in plan.ranks] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert [b.nodes for b in plan.ranks] == [(0, 1), (2, 3)]
    # More ranks than physical cores: hardware threads are used, one block each.
    assert BindingPlan.split_allowed_cpus(topo, 16).ranks[15].cpus == (15,)
