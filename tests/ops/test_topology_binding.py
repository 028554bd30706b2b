"""Topology reading and binding plans against fake sysfs trees, and a real
binding applied in a spawned process."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
from pathlib import Path

import pytest

from numaov.runtime.placement.binding import (
    BIND_ENV,
    PER_NODE,
    SPLIT,
    BindingError,
    BindingPlan,
    RankCountError,
    apply_rank_binding,
    check_bind_string,
    memory_bind_nodes,
    plan_for_ranks,
)
from numaov.runtime.placement.topology import (
    IsaFlags,
    NumaNode,
    ShmSpace,
    Topology,
    format_cpu_list,
    parse_cpu_list,
    read_topology,
)

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
    # More ranks than NUMA nodes: the allowed CPUs are split instead.
    assert BindingPlan.default(topo, ranks=5).source == SPLIT


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
        ("0-1|99", None, r"entry 1 \('99'\): CPU 99 is not an online CPU"),
        ("0-x", None, "entry 0 .*'0-x' is not a CPU id or a range"),
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
    with pytest.raises(BindingError, match="CPU 3 is not an online CPU"):
        BindingPlan.from_bind_string("3|4", topo)


def test_container_with_restricted_affinity(two_socket_smt) -> None:
    sys_root, proc_root = two_socket_smt
    topo = read_topology(sys_root, proc_root, allowed_cpus=(2, 3, 10, 11))
    plan = BindingPlan.default(topo)
    assert [b.cpus for b in plan.ranks] == [(2, 3)]
    assert plan.ranks[0].nodes == (1,)
    # One usable node for two ranks: its two allowed physical cores, one each.
    assert [b.cpus for b in BindingPlan.default(topo, ranks=2).ranks] == [(2,), (3,)]
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


# -- the one rule: NUMAOV_CPU_BIND, else one rank per NUMA node, else the allowed CPUs split --


def fake_topology(nodes: dict[int, tuple[int, ...]], allowed: tuple[int, ...] | None = None
                  ) -> Topology:
    """A machine without SMT: node id -> its CPUs (each its own physical core)."""
    online = tuple(sorted(c for cpus in nodes.values() for c in cpus))
    return Topology(
        nodes=tuple(NumaNode(n, cpus, cpus, None) for n, cpus in nodes.items()),
        online_cpus=online, allowed_cpus=online if allowed is None else allowed,
        core_siblings={c: (c,) for c in online}, isa=IsaFlags(),
        shm=ShmSpace("/dev/shm", None, None),
    )


ONE_NODE = fake_topology({0: (0, 1, 2, 3)})
TWO_NODES = fake_topology({0: (0, 1, 2, 3), 1: (4, 5, 6, 7)})


def test_fewer_nodes_than_ranks_splits_the_allowed_cpus_and_says_so(caplog, monkeypatch) -> None:
    from numaov.runtime.placement import binding

    monkeypatch.setattr(binding, "_warned_splits", set())
    with caplog.at_level(logging.WARNING, logger="numaov.runtime.placement.binding"):
        plan = plan_for_ranks(2, env={}, topology=ONE_NODE)
        # Planned again (the demo's second backend, a service's restart): said once.
        assert plan_for_ranks(2, env={}, topology=ONE_NODE) == plan
    assert plan.source == SPLIT
    assert [b.cpus for b in plan.ranks] == [(0, 1), (2, 3)]
    assert [b.nodes for b in plan.ranks] == [(0,), (0,)]
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert "2 rank(s) but 1 usable NUMA node(s)" in record.getMessage()
    assert "rank 1 on CPUs 2-3" in record.getMessage() and BIND_ENV in record.getMessage()


def test_as_many_nodes_as_ranks_gives_one_rank_per_node_without_a_warning(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="numaov.runtime.placement.binding"):
        plan = plan_for_ranks(2, env={}, topology=TWO_NODES)
        assert plan_for_ranks(1, env={}, topology=TWO_NODES).ranks[0].cpus == (0, 1, 2, 3)
    assert plan.source == PER_NODE
    assert [b.cpus for b in plan.ranks] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert caplog.records == []
    # No rank count asked for: one rank per node.
    assert BindingPlan.resolve(TWO_NODES, env={}).world_size == 2


def test_a_bind_string_decides_whatever_the_nodes(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="numaov.runtime.placement.binding"):
        plan = plan_for_ranks(3, env={BIND_ENV: "0|1|2-3"}, topology=ONE_NODE)
    assert plan.source == BIND_ENV
    assert [b.cpus for b in plan.ranks] == [(0,), (1,), (2, 3)]
    assert caplog.records == []


def test_split_blocks_stay_contiguous_and_on_one_node_when_counts_divide() -> None:
    plan = BindingPlan.resolve(TWO_NODES, 4, env={})
    assert [b.cpus for b in plan.ranks] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert [b.nodes for b in plan.ranks] == [(0,), (0,), (1,), (1,)]
    # Only the allowed CPUs are split.
    limited = fake_topology({0: (0, 1, 2, 3)}, allowed=(1, 3))
    assert [b.cpus for b in BindingPlan.resolve(limited, 2, env={}).ranks] == [(1,), (3,)]


def test_split_uses_hardware_threads_only_with_more_ranks_than_cores(two_socket_smt) -> None:
    sys_root, proc_root = two_socket_smt
    topo = read_topology(sys_root, proc_root, allowed_cpus=tuple(range(16)))
    assert [b.cpus for b in BindingPlan.resolve(topo, 8, env={}).ranks][:2] == [(0,), (1,)]
    assert BindingPlan.resolve(topo, 16, env={}).ranks[15].cpus == (15,)


@pytest.mark.parametrize(("bind", "message"), [
    # A bad entry is named before the entry count is looked at.
    ("5", r"entry 0 \('5'\): CPU 5 is not an online CPU of this machine; expected CPUs from 0-3"),
    ("a-b", r"entry 0 \('a-b'\): 'a-b' is not a CPU id or a range of them"),
    ("0|1|9", r"entry 2 \('9'\): CPU 9 is not an online CPU"),
])
def test_a_bad_entry_is_named_before_the_entry_count(bind: str, message: str) -> None:
    with pytest.raises(BindingError, match=message) as caught:
        plan_for_ranks(2, env={BIND_ENV: bind}, topology=ONE_NODE)
    assert not isinstance(caught.value, RankCountError)


def test_the_entry_count_is_checked_after_the_entries() -> None:
    with pytest.raises(RankCountError, match=r"'0\|1\|2' has 3 CPU list\(s\) but 2 rank\(s\)"):
        plan_for_ranks(2, env={BIND_ENV: "0|1|2"}, topology=ONE_NODE)


def test_work_in_this_process_still_checks_a_set_bind_string(caplog, two_cpus) -> None:
    with pytest.raises(BindingError, match=r"entry 1 \('x'\)"):
        check_bind_string("sampling", env={BIND_ENV: f"{two_cpus[0]}|x"})
    with caplog.at_level(logging.WARNING, logger="numaov.runtime.placement.binding"):
        check_bind_string("sampling", env={})
        assert caplog.records == []
        check_bind_string("sampling", env={BIND_ENV: f"{two_cpus[0]}"})
    assert "sampling runs in this process, which is not pinned" in caplog.records[0].getMessage()
    with caplog.at_level(logging.WARNING, logger="numaov.runtime.placement.binding"):
        check_bind_string("sampling", env={BIND_ENV: f"{two_cpus[0]}"})
    assert len(caplog.records) == 1, "the same work warned twice in one process"
