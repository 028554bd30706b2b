"""numaov's shared-memory collectives against DeepSpeed's, two ranks pinned one core each.

The anchor is DeepSpeed's shared-memory all_reduce (``deepspeed.comm.inference_all_reduce``
with ``DS_ACCELERATOR=cpu``: its JIT-built ``shm_comm`` op; install it with
``pip install --no-build-isolation -e ".[bench]"``). DeepSpeed has no shared-memory
all_gather_into_tensor, reduce_scatter_tensor, all_to_all or broadcast (it runs them on gloo),
so for those ops the anchor is gloo (``torch.distributed``; for all_to_all its
``all_to_all_single`` with equal splits). Without DeepSpeed the script says so and measures
all_reduce against gloo as well. All competitors run in the same two processes.

The script runs ``--rounds`` rounds. In each round, for every dtype, op and size, a barrier
probe (the mean time of a numaov barrier, over many) tags the machine's state, then numaov and
its anchor are timed back to back, in alternating order from round to round. A state is "fast"
when the probe is within ``--slow-factor`` of the lowest probe of the run, else "slow" (or set
``--slow-probe-us``). The report gives, per state and dtype, best and median of numaov and the
anchor and their ratios, the targets, and the probes seen; single-core memcpy of each size is
measured first, while the other rank blocks, as the bound a copy-based transport approaches.
Writes benchmarks/out/collectives.json.

Targets: numaov's all_reduce at least 1.2x DeepSpeed's at every size (best and median, every
dtype, every state seen); no size slower in the slow state than 2x its fast-state time;
all_gather_into_tensor and reduce_scatter_tensor at 16 MiB at least 60% of single-core memcpy.

Size is the largest buffer of the call (the tensor for all_reduce and broadcast, the output of
all_gather_into_tensor, the input of reduce_scatter_tensor, either buffer of all_to_all).

    python benchmarks/collectives.py [--dtypes float32,bfloat16] [--cpus 0,1] [--rounds 3]
                                     [--budget-s 0.1] [--ops all_reduce,...] [--max-size-mib 64]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import subprocess
import tempfile
import time
import traceback
import uuid
from pathlib import Path
from typing import Any

OPS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all", "broadcast")
SIZES = [4 << 10 << (2 * i) for i in range(8)]  # 4 KiB, 16 KiB, ..., 64 MiB
OUT = Path(__file__).resolve().parent / "out"
SAMPLE_S, MIN_SAMPLES, MAX_SAMPLES = 1e-3, 5, 200
PROBE_BUDGET_S = 0.015  # ~15 samples of ~1 ms of barriers
ANCHOR_RATIO = 1.2  # numaov's all_reduce against DeepSpeed's, best and median
SLOW_STATE_LIMIT = 2.0  # slow-state time over fast-state time, every size
MEMCPY_TARGET, MEMCPY_SIZE = 0.6, 16 << 20  # all_gather / reduce_scatter against memcpy
# What the rank processes need in their environment before DeepSpeed is imported: its CPU
# accelerator, one OpenMP thread (its copies are OpenMP loops; each rank has one core), and
# LOCAL_SIZE == world size, without which it does not use shared memory.
DEEPSPEED_ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}


def _seconds_per_call(fn: Any, budget_s: float, sync: Any, agree: Any) -> tuple[float, float]:
    """(best, median) over samples of the mean time per call. `sync` lines the ranks up per
    sample and `agree` makes every rank run the same number of calls (the largest any asks).

    Samples of about a millisecond, many of them: on a shared machine other processes preempt
    the pinned ranks at random, which inflates some samples by milliseconds and leaves others
    untouched; best and median together say how much.
    """
    fn()
    fn()  # warm-up: page faults, first-touch, caches
    sync()
    start = time.perf_counter()
    fn()
    single = max(time.perf_counter() - start, 1e-7)
    per_sample = agree(max(1, min(10_000, int(SAMPLE_S / single))))
    count = agree(max(MIN_SAMPLES, min(MAX_SAMPLES, int(budget_s / (per_sample * single)))))
    samples = []
    for _ in range(count):
        sync()
        start = time.perf_counter()
        for _ in range(per_sample):
            fn()
        samples.append((time.perf_counter() - start) / per_sample)
    samples.sort()
    return samples[0], samples[len(samples) // 2]


def _barrier_probe_us(barrier: Any, agree: Any) -> float:
    """The median time of one barrier, in us: the round trip between the two cores, which is
    what tells the machine's states apart."""
    return _seconds_per_call(barrier, PROBE_BUDGET_S, barrier, agree)[1] * 1e6


def _buffers(torch: Any, op: str, size: int, dtype: Any, world: int) -> tuple[Any, Any]:
    # Zeros: repeated sums stay finite (no inf or NaN arithmetic in the timed loop).
    n = size // torch.empty((), dtype=dtype).element_size()
    if op == "all_gather_into_tensor":
        return torch.empty(n, dtype=dtype), torch.zeros(n // world, dtype=dtype)
    if op == "reduce_scatter_tensor":
        return torch.empty(n // world, dtype=dtype), torch.zeros(n, dtype=dtype)
    if op == "all_to_all":
        return torch.empty(n, dtype=dtype), torch.zeros(n, dtype=dtype)
    return torch.zeros(n, dtype=dtype), None


def _call(comm: Any, op: str, a: Any, b: Any) -> Any:
    if op == "all_reduce":
        return lambda: comm.all_reduce(a)
    if op == "broadcast":
        return lambda: comm.broadcast(a, 0)
    return lambda: getattr(comm, op)(a, b)


class _DeepSpeedAllReduce:
    """DeepSpeed's shared-memory all_reduce behind the one method the benchmark calls."""

    def __init__(self, dcomm: Any) -> None:
        self._dcomm = dcomm

    def all_reduce(self, t: Any) -> None:
        self._dcomm.inference_all_reduce(t)


def _rank_main(rank: int, world: int, args: dict, gate: Any, results: Any) -> None:
    try:
        results.put((rank, _measure(rank, world, args, gate)))
    except BaseException:
        results.put((rank, {"error": traceback.format_exc()}))
        raise


def _join(rank: int, world: int, args: dict) -> Any:
    """torch.distributed (gloo) for both ranks, through DeepSpeed when it is used: its
    shared-memory op joins at the same time. Returns DeepSpeed's comm module or None."""
    import torch.distributed as dist

    if args["deepspeed"] is None:
        dist.init_process_group("gloo", init_method=f"file://{args['store']}", rank=rank,
                                world_size=world)
        return None
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(args["port"]))
    import deepspeed
    import deepspeed.comm as dcomm

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    return dcomm


def _measure(rank: int, world: int, args: dict, gate: Any) -> dict:
    os.environ.update(DEEPSPEED_ENV)
    os.sched_setaffinity(0, {args["cpus"][rank]})
    import numpy as np
    import torch
    import torch.distributed as dist

    from numaov.distributed.communicator import GlooCommunicator, ShmCommunicator

    torch.set_num_threads(1)
    out: dict[str, Any] = {"memcpy": {}, "records": []}
    # 1. Single-core memcpy, while the other rank blocks (not spins) on the gate.
    if rank == 0:
        for size in args["sizes"]:
            src = np.ones(size, np.uint8)
            dst = np.empty_like(src)
            out["memcpy"][size] = _seconds_per_call(
                lambda s=src, d=dst: np.copyto(d, s), args["budget_s"], lambda: None,
                lambda n: n)
    gate.wait()
    dcomm = _join(rank, world, args)
    ours = ShmCommunicator(args["group"], rank, world, job_id=args["group"])
    gloo = GlooCommunicator(args["group"] + "-gloo", dist.group.WORLD)
    # all_reduce always: the agreement check below reads its anchor whatever --ops says.
    anchors = {op: ("gloo", gloo) for op in {*args["ops"], "all_reduce"}}
    if dcomm is not None:
        anchors["all_reduce"] = ("deepspeed", _DeepSpeedAllReduce(dcomm))

    def agree(n: int) -> int:
        value = torch.tensor([n])
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return int(value)

    # 2. Both implementations sum alike: a pair of random vectors, once per dtype.
    checks = {}
    for dtype_name in args["dtypes"]:
        dtype = getattr(torch, dtype_name)
        x = torch.randn(100_003, generator=torch.Generator().manual_seed(rank)).to(dtype)
        a, b = x.clone(), x.clone()
        ours.all_reduce(a)
        anchors["all_reduce"][1].all_reduce(b)
        checks[dtype_name] = float((a.float() - b.float()).abs().max())
    out["max_difference"] = checks
    # 3. Rounds: per dtype, op and size, the probe, then numaov and its anchor back to back.
    for round_index in range(args["rounds"]):
        for dtype_name in args["dtypes"]:
            dtype = getattr(torch, dtype_name)
            for op in args["ops"]:
                anchor_name, anchor = anchors[op]
                for size in args["sizes"]:
                    a, b = _buffers(torch, op, size, dtype, world)
                    record = {"round": round_index, "dtype": dtype_name, "op": op, "size": size,
                              "anchor_name": anchor_name, "probe_us": _barrier_probe_us(ours.barrier, agree)}
                    order = [("numaov", ours), ("anchor", anchor)]
                    for name, comm in order[:: 1 if round_index % 2 == 0 else -1]:
                        record[name] = _seconds_per_call(_call(comm, op, a, b),
                                                         args["budget_s"], ours.barrier, agree)
                    out["records"].append(record)
    out["isa"] = ours._comm.isa
    out["limits"] = {d: ours.algorithm_limits(d) for d in args["dtypes"]}
    ours.close()
    gloo.close()
    dist.destroy_process_group()
    return out


def _deepspeed_status() -> tuple[str | None, str]:
    """(version, "") when DeepSpeed's shared-memory op builds here, else (None, why not).
    Building it once here, in the parent, keeps the two ranks from compiling it side by side."""
    os.environ.update(DEEPSPEED_ENV)
    try:
        import deepspeed
        from deepspeed.accelerator import get_accelerator
    except ImportError as exc:
        return None, (f"deepspeed is not installed ({exc}); it is the extra 'bench': "
                      "pip install --no-build-isolation -e '.[bench]'")
    try:
        builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
        if builder is None or not builder.is_compatible():
            return None, "DeepSpeed's CPU accelerator has no shared-memory op on this machine"
        builder.load(verbose=False)
    except Exception as exc:  # a failed JIT build: report it, measure without the anchor
        return None, f"DeepSpeed's shared-memory op did not build: {exc}"
    return deepspeed.__version__, ""


def _fmt_bytes(n: float) -> str:
    return f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def _states(records: list[dict], slow_probe_us: float | None, slow_factor: float) -> float:
    """Tags every record "fast" or "slow" by its probe; returns the probe threshold."""
    threshold = slow_probe_us or min(r["probe_us"] for r in records) * slow_factor
    for r in records:
        r["state"] = "slow" if r["probe_us"] > threshold else "fast"
    return threshold


def _summary(records: list[dict]) -> dict:
    """Per (state, dtype, op, size): best of the bests, median of the medians, of numaov and
    its anchor, and how many rounds fell in that state."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["state"], r["dtype"], r["op"], r["size"]), []).append(r)
    summary = {}
    for key, rs in groups.items():
        entry = {"rounds": len(rs), "anchor_name": rs[0]["anchor_name"],
                 "probe_us": [min(r["probe_us"] for r in rs), max(r["probe_us"] for r in rs)]}
        for name in ("numaov", "anchor"):
            entry[name] = {"best": min(r[name][0] for r in rs),
                           "median": statistics.median(r[name][1] for r in rs),
                           "medians": sorted(r[name][1] for r in rs)}
        ratios = [r["anchor"][1] / r["numaov"][1] for r in rs]
        entry["median_ratio_range"] = [min(ratios), max(ratios)]
        summary[key] = entry
    return summary


def _report(merged: dict) -> tuple[str, dict]:
    summary, memcpy = merged["summary"], merged["memcpy"]
    lines = [f"2 ranks x 1 core (CPUs {merged['cpus']}), {merged['cpu_model']}, "
             f"{merged['isa']} kernels; anchor for all_reduce: {merged['all_reduce_anchor']}; "
             f"load average {merged['load_before']} -> {merged['load_after']}",
             f"states: fast = barrier probe <= {merged['threshold_us']:.2f} us, slow above; "
             f"max |numaov - anchor| of one all_reduce: {merged['max_difference']}"]
    verdict: dict[str, bool] = {}
    for state in ("fast", "slow"):
        for dtype in merged["dtypes"]:
            keys = [k for k in summary if k[0] == state and k[1] == dtype]
            if not keys:
                continue
            probes = [p for k in keys for p in summary[k]["probe_us"]]
            lines.append(f"\n{state} state, {dtype} (probe {min(probes):.2f}-{max(probes):.2f} us)")
            lines.append(f"{'op':<24}{'size':>8}{'rounds':>7}{'numaov us':>16}"
                         f"{'anchor us':>16}{'x best':>8}{'x med':>7}{'x med range':>13}"
                         f"{'% memcpy':>10}  anchor")
            for op in merged["ops"]:
                for size in merged["sizes"]:
                    e = summary.get((state, dtype, op, size))
                    if e is None:
                        continue
                    ours, anchor = e["numaov"], e["anchor"]
                    best = anchor["best"] / ours["best"]
                    median = anchor["median"] / ours["median"]
                    of_memcpy = memcpy[size][0] / ours["best"]
                    low, high = e["median_ratio_range"]
                    lines.append(
                        f"{op:<24}{_fmt_bytes(size):>8}{e['rounds']:>7}"
                        f"{ours['best'] * 1e6:>8.1f}/{ours['median'] * 1e6:<7.1f}"
                        f"{anchor['best'] * 1e6:>8.1f}/{anchor['median'] * 1e6:<7.1f}"
                        f"{best:>8.2f}{median:>7.2f}{low:>8.2f}-{high:<4.2f}{of_memcpy:>10.0%}"
                        f"  {e['anchor_name']}")
                    name = f"{state} {dtype} {op} {_fmt_bytes(size)}"
                    if op == "all_reduce" and e["anchor_name"] == "deepspeed":
                        verdict[f"{name} >= {ANCHOR_RATIO}x DeepSpeed (best, median)"] = (
                            best >= ANCHOR_RATIO and median >= ANCHOR_RATIO)
                    if (op in ("all_gather_into_tensor", "reduce_scatter_tensor")
                            and size == MEMCPY_SIZE):
                        verdict[f"{name} >= {MEMCPY_TARGET:.0%} of memcpy"] = (
                            of_memcpy >= MEMCPY_TARGET)
    for (state, dtype, op, size), e in summary.items():
        fast = summary.get(("fast", dtype, op, size))
        if state == "slow" and fast is not None:
            slowdown = e["numaov"]["best"] / fast["numaov"]["best"]
            verdict[f"{dtype} {op} {_fmt_bytes(size)} slow/fast {slowdown:.2f} <= "
                    f"{SLOW_STATE_LIMIT}"] = slowdown <= SLOW_STATE_LIMIT
    missed = [k for k, ok in verdict.items() if not ok]
    lines.append(f"\ntargets met: {len(verdict) - len(missed)}/{len(verdict)}"
                 + ("".join(f"\n  missed: {k}" for k in missed)))
    return "\n".join(lines), verdict


def _cpu_model() -> str:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor()
    for line in text.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="float32,bfloat16",
                        help="comma-separated subset of float32, bfloat16, float16")
    parser.add_argument("--cpus", default="0,1", help="the two CPUs to pin rank 0 and 1 to")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every measurement")
    parser.add_argument("--budget-s", type=float, default=0.1,
                        help="measuring time per competitor, op, size and round")
    parser.add_argument("--ops", default=",".join(OPS), help="comma-separated subset of " +
                        ", ".join(OPS))
    parser.add_argument("--sizes-kib", default=None,
                        help="comma-separated message sizes in KiB instead of 4 KiB, 16 KiB, ...")
    parser.add_argument("--min-size-kib", type=float, default=4.0,
                        help="smallest message size measured")
    parser.add_argument("--max-size-mib", type=float, default=64.0,
                        help="largest message size measured")
    parser.add_argument("--slow-factor", type=float, default=1.4,
                        help="a probe above this times the run's lowest one is the slow state")
    parser.add_argument("--slow-probe-us", type=float, default=None,
                        help="a fixed probe threshold of the slow state instead")
    parser.add_argument("--no-deepspeed", action="store_true",
                        help="measure all_reduce against gloo even if DeepSpeed is installed")
    opts = parser.parse_args()
    ops, dtypes = opts.ops.split(","), opts.dtypes.split(",")
    if not set(ops) <= set(OPS):
        parser.error(f"--ops {opts.ops!r}; expected a subset of {', '.join(OPS)}")
    if not set(dtypes) <= {"float32", "bfloat16", "float16"}:
        parser.error(f"--dtypes {opts.dtypes!r}; expected a subset of float32, bfloat16, "
                     "float16")
    sizes = ([int(float(k) * 2**10) for k in opts.sizes_kib.split(",")] if opts.sizes_kib
             else SIZES)
    sizes = [s for s in sizes if opts.min_size_kib * 2**10 <= s <= opts.max_size_mib * 2**20]
    version, why = (None, "--no-deepspeed") if opts.no_deepspeed else _deepspeed_status()
    if version is None:
        print(f"DeepSpeed is not available ({why}): all_reduce is measured against gloo only, "
              "and the DeepSpeed targets are not checked")
    cpus = [int(c) for c in opts.cpus.split(",")]
    world = 2
    group = f"bench-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    ctx = mp.get_context("spawn")
    gate, results = ctx.Barrier(world), ctx.Queue()
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    with tempfile.TemporaryDirectory() as tmp:
        args = {"cpus": cpus, "group": group, "store": f"{tmp}/store", "dtypes": dtypes,
                "budget_s": opts.budget_s, "ops": ops, "sizes": sizes, "rounds": opts.rounds,
                "deepspeed": version, "port": _free_port()}
        procs = [ctx.Process(target=_rank_main, args=(r, world, args, gate, results))
                 for r in range(world)]
        for p in procs:
            p.start()
        per_rank = dict(results.get(timeout=7200) for _ in procs)
        for p in procs:
            p.join()
    # DeepSpeed's shared-memory op leaves its buffers (69 MB each, two per rank) in /dev/shm,
    # named by the address and port it joined on: remove this run's.
    for leftover in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{args['port']}_*"):
        leftover.unlink(missing_ok=True)
    errors = [r["error"] for r in per_rank.values() if "error" in r]
    if errors:
        raise SystemExit("a rank failed:\n" + errors[0])
    # A collective is as slow as its slowest rank: per record, the slower rank's figures.
    records = []
    for r0, r1 in zip(per_rank[0]["records"], per_rank[1]["records"], strict=True):
        merged_record = dict(r0, probe_us=max(r0["probe_us"], r1["probe_us"]))
        for name in ("numaov", "anchor"):
            merged_record[name] = [max(r0[name][i], r1[name][i]) for i in (0, 1)]
        records.append(merged_record)
    threshold = _states(records, opts.slow_probe_us, opts.slow_factor)
    merged: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu_model": _cpu_model(),
        "cpus": cpus, "isa": per_rank[0]["isa"], "dtypes": dtypes, "ops": ops, "sizes": sizes,
        "all_reduce_anchor": f"DeepSpeed {version} shm" if version else "gloo",
        "deepspeed": version, "load_before": load_before,
        "load_after": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "memcpy": per_rank[0]["memcpy"], "limits": per_rank[0]["limits"],
        "max_difference": per_rank[0]["max_difference"], "threshold_us": threshold,
        "records": records, "summary": _summary(records)}
    text, verdict = _report(merged)
    print(text)
    OUT.mkdir(exist_ok=True)
    merged["targets"] = verdict
    merged["summary"] = {"/".join(map(str, k)): v for k, v in merged["summary"].items()}
    path = OUT / "collectives.json"
    path.write_text(json.dumps(merged, indent=1, default=str))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
