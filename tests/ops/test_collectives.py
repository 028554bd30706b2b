"""The shared-memory collectives: results against torch.distributed (gloo) and an exact reference.

Every op runs on spawned ranks for world sizes 2, 3 and 4 (all_to_all also 5) in float32,
bfloat16 and float16, at 1 element, an unaligned size, each algorithm threshold -1/+1
(all_reduce's one-shot limit and every op's chunk size, which is also where a message outgrows
the buffer) and, once, 40 MiB; all_to_all also on a 3-d tensor and in place. Then a random
interleaving of ops with random per-rank delays, a world of 8 ranks, the sum kernels on every
instruction set, world size 1, the communicator's all_to_all argument checks and the group
registry. Failure handling
(mismatch, timeout, a killed rank, stale segments, a full /dev/shm) is in
test_collectives_failures.py.

The exact reference is the definition the communicator promises: inputs added in rank order in
fp32, rounded once to the dtype (round to nearest even). Results must equal it bit for bit
(NaN compared by position) and be bit-identical across ranks. The ops that only move data
(all_gather_into_tensor, all_to_all, broadcast) must equal gloo byte for byte, NaN included.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.collectives_harness import SEED, RankGroup, run_ranks, shm_leftovers, unique_name

pytestmark = pytest.mark.slow  # spawned rank processes

DTYPE_NAMES = ("float32", "bfloat16", "float16")
DTYPE_CODES = {"float32": 0, "bfloat16": 1, "float16": 2}
# One ulp of 1.0: the relative spacing of each dtype.
ULP_OF_ONE = {"float32": 2.0**-23, "bfloat16": 2.0**-7, "float16": 2.0**-10}
OPS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all", "broadcast")
# Ops whose result is the same on every rank (reduce_scatter gives each rank its own block).
REPLICATED = {"all_reduce", "all_gather_into_tensor", "broadcast", "all_gather"}
BIG_BYTES = 40 << 20


# ---------------------------------------------------------------------------------------------
# Reference math and comparisons (torch), used inside the rank processes.
# ---------------------------------------------------------------------------------------------


def _inputs(seed: int, case: int, world: int, shape: tuple[int, ...], dtype_name: str) -> list:
    """Every rank's input for one case: each rank can compute all of them, no exchange needed."""
    import torch

    dtype = getattr(torch, dtype_name)
    return [
        (torch.randn(shape, generator=torch.Generator().manual_seed(seed * 7919 + case * 131 + r))
         * 4).to(dtype)
        for r in range(world)
    ]


def _with_specials(xs: list) -> list:
    """NaN, infinities, overflow, subnormals and signed zero at the start of every rank's input."""
    import torch

    info = torch.finfo(xs[0].dtype)
    xs = [x.clone() for x in xs]
    xs[-1][0] = float("nan")  # a NaN from one rank stays NaN
    xs[0][1], xs[-1][1] = float("inf"), float("-inf")  # inf + -inf is NaN
    xs[0][3] = float("inf")  # inf plus finite values stays inf
    for x in xs:
        x[2] = info.max  # two maxima overflow to inf
        x[4] = info.tiny / 8  # subnormal: the sum is exact
        x[5] = -0.0  # -0 + -0 keeps its sign
    return xs


def _sum_in_order(blocks: list) -> Any:
    acc = blocks[0].float()
    for block in blocks[1:]:
        acc = acc + block.float()
    return acc.to(blocks[0].dtype)


def _bits(t: Any) -> Any:
    import torch

    return t.reshape(-1).view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def _bit_difference(ours: Any, ref: Any) -> str | None:
    """None if equal bit for bit (NaN by position only, its payload is not specified)."""
    import torch

    if ours.shape != ref.shape:
        return f"shape {tuple(ours.shape)}, expected {tuple(ref.shape)}"
    nan = torch.isnan(ours.reshape(-1))
    if not torch.equal(nan, torch.isnan(ref.reshape(-1))):
        return "NaN at different positions"
    same = (_bits(ours) == _bits(ref)) | nan
    if bool(same.all()):
        return None
    i = int((~same).nonzero()[0])
    return f"element {i} is {ours.reshape(-1)[i].item()!r}, expected {ref.reshape(-1)[i].item()!r}"


def _gloo_difference(ours: Any, theirs: Any, blocks: list | None, world: int,
                     dtype_name: str) -> str | None:
    """Copies must equal gloo's bit for bit; sums only within gloo's rounding.

    gloo adds the ranks in its own order and, for 16-bit types, rounds after every addition.
    Each rounding is off by at most half an ulp of a partial sum, and every partial sum is at
    most sum_r |x_r|; with up to world-1 roundings on gloo's side and one on ours,
    |ours - gloo| <= world * ulp(1) * sum_r |x_r|. With two ranks both sides round the one
    addition once, so the results must be identical.
    """
    import torch

    if blocks is None or world == 2:
        return _bit_difference(ours, theirs)
    a, b = ours.float().reshape(-1), theirs.float().reshape(-1)
    nan, inf = torch.isnan(a), torch.isinf(a)
    if not (torch.equal(nan, torch.isnan(b)) and torch.equal(inf, torch.isinf(b))
            and torch.equal(a[inf], b[inf])):
        return "NaN or infinities at different positions"
    bound = ULP_OF_ONE[dtype_name] * world * sum(x.float().abs() for x in blocks).reshape(-1)
    gap = (a - b).abs()
    bad = ~(nan | inf) & (gap > bound)
    if not bool(bad.any()):
        return None
    i = int(bad.nonzero()[0])
    return f"element {i} differs from gloo by {gap[i].item()}, bound {bound[i].item()}"


def _run_case(comm: Any, op: str, rank: int, world: int, xs: list, arg: int,
              as_numpy: bool = False) -> tuple[Any, Any, list | None]:
    """Run one collective; returns (ours, exact reference, blocks summed or None for copies).

    `arg` is broadcast's root or all_gather's dim. With `as_numpy` the communicator gets numpy
    views of the torch buffers (the results land in the same memory).
    """
    import torch

    def view(t: Any) -> Any:
        return t.numpy() if as_numpy else t

    x = xs[rank]
    if op == "all_reduce":
        ours = x.clone()
        comm.all_reduce(view(ours))
        return ours, _sum_in_order(xs), xs
    if op == "reduce_scatter_tensor":
        n = x.numel() // world
        blocks = [xr[rank * n:(rank + 1) * n] for xr in xs]
        ours = x.new_empty(n)
        comm.reduce_scatter_tensor(view(ours), view(x))
        return ours, _sum_in_order(blocks), blocks
    if op == "all_gather_into_tensor":
        ours = x.new_empty(world * x.numel())
        comm.all_gather_into_tensor(view(ours), view(x))
        return ours, torch.cat([xr.reshape(-1) for xr in xs]), None
    if op in ("all_to_all", "all_to_all in place"):
        # Block `rank` of every rank's dim 0, in rank order.
        exact = torch.cat([xr.chunk(world)[rank] for xr in xs])
        if op == "all_to_all":
            ours = x.new_empty(x.shape)
            comm.all_to_all(view(ours), view(x))
        else:
            ours = x.clone()
            comm.all_to_all(view(ours), view(ours))
        return ours, exact, None
    if op == "broadcast":
        ours = x.clone()
        comm.broadcast(view(ours), arg)
        return ours, xs[arg], None
    if op == "all_gather":
        ours = comm.all_gather(view(x), arg)
        return (torch.from_numpy(ours) if as_numpy else ours), torch.cat(xs, dim=arg), None
    raise AssertionError(op)


def _case_inputs(seed: int, case: int, world: int, op: str, n: int, dtype_name: str) -> list:
    # reduce_scatter's and all_to_all's inputs hold one block of n per rank.
    blocks = op in ("reduce_scatter_tensor", "all_to_all", "all_to_all in place")
    return _inputs(seed, case, world, (n * world if blocks else n,), dtype_name)


def _digest(t: Any) -> str:
    return hashlib.sha1(_bits(t.contiguous()).numpy().tobytes()).hexdigest()


# ---------------------------------------------------------------------------------------------
# Every op against gloo, world sizes 2, 3, 4 (and all_to_all at 5).
# ---------------------------------------------------------------------------------------------


def _sizes(limits: dict[str, int], op: str) -> list[int]:
    chunk = limits[f"{op}_chunk"]
    sizes = {1, 4097, chunk - 1, chunk + 1}
    if op == "all_reduce":
        sizes |= {limits["oneshot_elements"] - 1, limits["oneshot_elements"] + 1}
    return sorted(sizes)


def _gloo_worker(rank: int, world: int, args: dict) -> dict:
    import torch
    import torch.distributed as dist

    from numaov.distributed.communicator import GlooCommunicator, ShmCommunicator

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{args['store']}", rank=rank,
                            world_size=world)
    shm = ShmCommunicator(args["group"], rank, world, job_id=args["job"], timeout_s=120)
    gloo = GlooCommunicator(args["group"] + "-gloo", dist.group.WORLD)
    problems: list[str] = []
    digests: dict[str, str] = {}
    case = 0

    def check(name: str, op: str, xs: list, arg: int, dtype_name: str) -> None:
        ours, exact, blocks = _run_case(shm, op, rank, world, xs, arg)
        theirs, _, _ = _run_case(gloo, op, rank, world, xs, arg)
        for what, gap in (("exact reference", _bit_difference(ours, exact)),
                          ("gloo", _gloo_difference(ours, theirs, blocks, world, dtype_name))):
            if gap is not None:
                problems.append(f"{name} vs {what}: {gap}")
        if blocks is None and not torch.equal(_bits(ours), _bits(theirs)):
            problems.append(f"{name}: not byte-identical to gloo (a copy: NaN payloads too)")
        if op in REPLICATED:
            digests[name] = _digest(ours)

    ops = args["ops"]
    for dtype_name in DTYPE_NAMES:
        limits = shm.algorithm_limits(dtype_name)
        for op in ops:
            for n in _sizes(limits, op):
                case += 1
                root = case % world
                xs = _case_inputs(args["seed"], case, world, op, n, dtype_name)
                check(f"{op} {dtype_name} n={n} root={root}", op, xs, root, dtype_name)
        for op in [o for o in ("all_reduce", "reduce_scatter_tensor", "all_to_all") if o in ops]:
            case += 1
            xs = _with_specials(_case_inputs(args["seed"], case, world, op, 37, dtype_name))
            check(f"{op} {dtype_name} special values", op, xs, 0, dtype_name)
        if "all_to_all" in ops:
            # Dim 0 split across ranks, odd trailing dims; then in place, over several chunks.
            case += 1
            xs = _inputs(args["seed"], case, world, (3 * world, 5, 7), dtype_name)
            check(f"all_to_all {dtype_name} 3-d", "all_to_all", xs, 0, dtype_name)
            case += 1
            n = 2 * limits["all_to_all_chunk"] + 3
            xs = _case_inputs(args["seed"], case, world, "all_to_all in place", n, dtype_name)
            check(f"all_to_all in place {dtype_name} n={n}", "all_to_all in place", xs, 0,
                  dtype_name)
        if "all_gather_into_tensor" in ops:
            for dim in (1, -1):
                case += 1
                xs = _inputs(args["seed"], case, world, (2, 3, 5), dtype_name)
                check(f"all_gather {dtype_name} dim={dim}", "all_gather", xs, dim, dtype_name)
    # numpy arrays of ml_dtypes' bfloat16 (the transports accept them by name) on gloo too
    ones = np.ones(9, dtype=np.float32)
    x = (ones * (rank + 1)).astype(_numpy_dtype("bfloat16"))
    gloo.all_reduce(x)
    if not np.array_equal(x.astype(np.float32), ones * (world * (world + 1) // 2)):
        problems.append(f"gloo all_reduce of a numpy bfloat16 array gave {x}")
    if args["big"]:
        # Larger than the buffer many times over: 40 MiB per tensor passed in.
        elements = BIG_BYTES // 4
        for op in ops:
            case += 1
            n = elements // world if op == "all_gather_into_tensor" else elements
            n = n // world if op in ("reduce_scatter_tensor", "all_to_all") else n
            xs = _case_inputs(args["seed"], case, world, op, n, "float32")
            check(f"{op} float32 40 MiB", op, xs, world - 1, "float32")
    shm.barrier()
    shm.close()
    gloo.close()
    dist.destroy_process_group()
    return {"problems": problems, "digests": digests}


def _assert_clean_and_identical(results: dict[int, dict]) -> None:
    problems = [f"rank {r}: {p}" for r, res in sorted(results.items()) for p in res["problems"]]
    assert not problems, "\n".join(problems[:20])
    names = results[0]["digests"].keys()
    differing = [n for n in names if len({res["digests"][n] for res in results.values()}) != 1]
    assert not differing, f"results not bit-identical across ranks: {differing[:10]}"


@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_every_op_matches_gloo_and_the_exact_sum(world: int, tmp_path: Path) -> None:
    seed = SEED + world
    print(f"seed={seed}")
    group = unique_name(f"vs-gloo-{world}")
    # Five ranks (on a 2-core machine) only for all_to_all, the op it was added for.
    ops = OPS if world <= 4 else ("all_to_all",)
    args = {"store": str(tmp_path / "store"), "group": group, "job": group, "seed": seed,
            "big": world == 2, "ops": ops}
    _assert_clean_and_identical(run_ranks(world, _gloo_worker, args))
    assert shm_leftovers(group) == []


# ---------------------------------------------------------------------------------------------
# Random interleaving of ops with random per-rank delays.
# ---------------------------------------------------------------------------------------------


def _interleave_worker(rank: int, world: int, args: dict) -> dict:
    import torch

    from numaov.distributed.communicator import ShmCommunicator

    torch.set_num_threads(1)
    # Non-temporal result stores from 4 KiB up (default 8 MiB), so unaligned destinations and
    # odd lengths go through them too.
    os.environ["NUMAOV_COLL_STREAM_BYTES"] = "4096"
    comm = ShmCommunicator(args["group"], rank, world, job_id=args["job"], timeout_s=60)
    plan = random.Random(args["seed"])  # the op sequence: the same on every rank
    arrival = random.Random(args["seed"] * 1000 + rank + 1)  # when this rank gets there
    problems: list[str] = []
    digests: dict[str, str] = {}
    for step in range(args["steps"]):
        op = plan.choice((*OPS, "all_gather", "barrier"))
        dtype_name = plan.choice(DTYPE_NAMES)
        n = round(10 ** plan.uniform(0, 5.5))  # 1 to ~316k elements
        arg = plan.randrange(world) if op != "all_gather" else plan.choice((0, 1, -1))
        as_numpy = dtype_name != "bfloat16" and plan.random() < 0.3
        time.sleep(arrival.choice((0.0, 0.0, 0.0, 1e-4, 1e-3, 5e-3)))
        if op == "barrier":
            comm.barrier()
            continue
        shape = (2, 3, max(1, n // 6)) if op == "all_gather" else None
        xs = (_inputs(args["seed"], step, world, shape, dtype_name) if shape
              else _case_inputs(args["seed"], step, world, op, n, dtype_name))
        ours, exact, _ = _run_case(comm, op, rank, world, xs, arg, as_numpy)
        name = f"step {step}: {op} {dtype_name} n={n} arg={arg} numpy={as_numpy}"
        gap = _bit_difference(ours, exact)
        if gap is not None:
            problems.append(f"{name}: {gap}")
        if op in REPLICATED:
            digests[name] = _digest(ours)
    seq = comm.seq
    comm.close()
    return {"problems": problems, "digests": digests, "seq": seq}


def test_random_interleaving_with_delays_is_exact_and_identical_on_every_rank() -> None:
    seed = SEED + 100
    print(f"seed={seed}")
    group = unique_name("interleave")
    results = run_ranks(3, _interleave_worker,
                        {"group": group, "job": group, "seed": seed, "steps": 80})
    _assert_clean_and_identical(results)
    assert {res["seq"] for res in results.values()} == {80}
    assert shm_leftovers(group) == []


# ---------------------------------------------------------------------------------------------
# Eight ranks (numpy only: no torch, no gloo), odd chunk counts, empty tensors.
# ---------------------------------------------------------------------------------------------


def _numpy_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _numpy_inputs(seed: int, case: int, world: int, n: int, dtype: np.dtype) -> list:
    return [(np.random.default_rng([seed, case, r]).standard_normal(n, np.float32) * 4)
            .astype(dtype) for r in range(world)]


def _numpy_sum(blocks: list) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):  # inf and NaN are part of the tests
        acc = blocks[0].astype(np.float32)
        for block in blocks[1:]:
            acc = acc + block.astype(np.float32)
        return acc.astype(blocks[0].dtype)


def _all_reduce_problems(comm: Any, rank: int, world: int, seed: int, case: int, n: int,
                         dtype_name: str) -> list[str]:
    """all_reduce of n random elements against the exact sum: [] or the one problem."""
    xs = _numpy_inputs(seed, case, world, n, _numpy_dtype(dtype_name))
    got = xs[rank].copy()
    comm.all_reduce(got)
    if got.tobytes() != _numpy_sum(xs).tobytes():
        return [f"all_reduce {dtype_name} n={n}: differs from the exact reference"]
    return []


def _eight_worker(rank: int, world: int, args: dict) -> list[str]:
    from numaov.distributed.communicator import ShmCommunicator

    comm = ShmCommunicator(args["group"], rank, world, job_id=args["job"], timeout_s=60)
    problems: list[str] = []
    case = 0
    for dtype_name in DTYPE_NAMES:
        dtype = _numpy_dtype(dtype_name)
        limits = comm.algorithm_limits(dtype_name)
        # Empty, tiny, unaligned, and one past a chunk (two rounds, the second of 1 element).
        for n in (0, 1, 4097, limits["reduce_scatter_tensor_chunk"] + 1):
            case += 1
            # reduce_scatter's and all_to_all's inputs
            xs = _numpy_inputs(args["seed"], case, world, n * world, dtype)
            heads = [x[:n] for x in xs]  # everyone else's
            root = case % world
            got = {"all_reduce": heads[rank].copy(), "reduce_scatter_tensor": np.empty(n, dtype),
                   "all_gather_into_tensor": np.empty(world * n, dtype),
                   "all_to_all": np.empty(world * n, dtype), "broadcast": heads[rank].copy()}
            comm.all_reduce(got["all_reduce"])
            comm.reduce_scatter_tensor(got["reduce_scatter_tensor"], xs[rank])
            comm.all_gather_into_tensor(got["all_gather_into_tensor"], heads[rank])
            comm.all_to_all(got["all_to_all"], xs[rank])
            comm.broadcast(got["broadcast"], root)
            mine = [x[rank * n:(rank + 1) * n] for x in xs]  # block `rank` of every rank's
            want = {"all_reduce": _numpy_sum(heads),
                    "reduce_scatter_tensor": _numpy_sum(mine),
                    "all_gather_into_tensor": np.concatenate(heads),
                    "all_to_all": np.concatenate(mine), "broadcast": heads[root]}
            problems += [f"{op} {dtype_name} n={n}: differs from the exact reference"
                         for op, value in got.items() if value.tobytes() != want[op].tobytes()]
        # all_reduce past its chunk: 8 unequal cache-line slices per chunk.
        case += 1
        problems += _all_reduce_problems(comm, rank, world, args["seed"], case,
                                         limits["all_reduce_chunk"] + 1, dtype_name)
    comm.barrier()
    comm.close()
    return problems


def test_eight_ranks_all_ops_exact() -> None:
    seed = SEED + 8
    print(f"seed={seed}")
    group = unique_name("eight")
    results = run_ranks(8, _eight_worker, {"group": group, "job": group, "seed": seed})
    assert [p for problems in results.values() for p in problems] == []
    assert shm_leftovers(group) == []


# ---------------------------------------------------------------------------------------------
# all_reduce at its algorithm boundaries: one-shot limit per dtype, chunks, and the blocks of
# the reduction that writes both the shared buffer and the output.
# ---------------------------------------------------------------------------------------------

ONESHOT_BYTES = 64 << 10  # a non-default one-shot limit (f32), set on every rank
SECOND_COPY_BLOCK_BYTES = 8 << 10  # kSecondCopyBlockBytes in csrc/kernels/reduce_kernels.cpp


def _boundary_worker(rank: int, world: int, args: dict) -> list[str]:
    from numaov.distributed.communicator import ShmCommunicator

    os.environ["NUMAOV_COLL_ONESHOT_BYTES"] = str(ONESHOT_BYTES)
    os.environ["NUMAOV_COLL_BUFFER_BYTES"] = str(64 << 10)  # many chunks per message
    comm = ShmCommunicator(args["group"], rank, world, job_id=args["job"], timeout_s=60)
    problems: list[str] = []
    case = 0
    for dtype_name in DTYPE_NAMES:
        dtype = _numpy_dtype(dtype_name)
        limits = comm.algorithm_limits(dtype_name)
        # 16-bit messages run one-shot up to a sixteenth of the f32 limit (in bytes).
        expected = ONESHOT_BYTES // (4 if dtype_name == "float32" else 16 * 2)
        if limits["oneshot_elements"] != expected:
            problems.append(f"{dtype_name}: one-shot limit {limits['oneshot_elements']} "
                            f"elements, expected {expected}")
        one, chunk = limits["oneshot_elements"], limits["all_reduce_chunk"]
        block = SECOND_COPY_BLOCK_BYTES // dtype.itemsize
        sizes = {one - 1, one, one + 1, chunk - 1, chunk + 1, 3 * chunk - 7}
        # A rank's slice of one chunk at, just under and just over a whole number of blocks.
        sizes |= {world * block * k + d for k in (1, 2) for d in (-1, 0, 1)}
        for n in sorted(sizes):
            case += 1
            problems += _all_reduce_problems(comm, rank, world, args["seed"], case, n, dtype_name)
    comm.barrier()
    comm.close()
    return problems


@pytest.mark.parametrize("world", [2, 3])
def test_all_reduce_is_exact_at_every_algorithm_boundary(world: int) -> None:
    seed = SEED + 200 + world
    print(f"seed={seed}")
    group = unique_name(f"boundary-{world}")
    results = run_ranks(world, _boundary_worker, {"group": group, "job": group, "seed": seed})
    assert [p for problems in results.values() for p in problems] == []
    assert shm_leftovers(group) == []


# ---------------------------------------------------------------------------------------------
# Sum kernels on every instruction set, in this process and against guard pages.
# ---------------------------------------------------------------------------------------------


def _native() -> Any:
    from numaov.distributed.communicator import _native as native

    return native()


def _isas() -> list[str]:
    order = ["scalar", "avx2", "avx512"]
    return order[: order.index(_native().best_isa()) + 1]


def _kernel(dst: np.ndarray, srcs: list[np.ndarray], count: int, dtype_name: str,
            isa: str) -> None:
    _native().reduce_sum(dst.ctypes.data, [s.ctypes.data for s in srcs], count,
                         DTYPE_CODES[dtype_name], isa)


def _same_bits_numpy(a: np.ndarray, b: np.ndarray) -> bool:
    wide = np.float32
    nan_a, nan_b = np.isnan(a.astype(wide)), np.isnan(b.astype(wide))
    ints = np.uint32 if a.dtype.itemsize == 4 else np.uint16
    return bool(np.array_equal(nan_a, nan_b) and
                np.array_equal(a.view(ints)[~nan_a], b.view(ints)[~nan_b]))


@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
def test_sum_kernels_are_exact_on_every_instruction_set(dtype_name: str) -> None:
    seed = SEED + 200
    print(f"seed={seed} isas={_isas()}")
    dtype = _numpy_dtype(dtype_name)
    rng = np.random.default_rng(seed)
    import ml_dtypes

    info = ml_dtypes.finfo(dtype)
    specials = np.array([np.nan, np.inf, -np.inf, info.max, -info.max, info.tiny / 8, -0.0,
                         16.0, 65504.0 if dtype_name == "float16" else 1.0], np.float32)
    sentinel = np.array(1234.5, np.float32).astype(dtype)
    for n_srcs in (1, 2, 3, 5, 8):
        for count in (0, 1, 7, 8, 9, 15, 16, 17, 31, 33, 63, 64, 65, 100, 1000, 4097):
            srcs = []
            for _ in range(n_srcs):
                values = rng.standard_normal(count).astype(np.float32) * 4
                where = rng.random(count) < 0.05
                values[where] = rng.choice(specials, int(where.sum()))
                srcs.append(values.astype(dtype))
            want = _numpy_sum(srcs) if count else np.empty(0, dtype)
            for isa in _isas():
                dst = np.full(count + 16, sentinel, dtype)
                _kernel(dst, srcs, count, dtype_name, isa)
                assert _same_bits_numpy(dst[:count], want), (isa, n_srcs, count)
                # Exact tail: nothing written past count.
                assert (dst[count:].view(np.uint8) == np.full(16, sentinel).view(np.uint8)).all()


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
def test_sum_kernels_round_ties_to_even(dtype_name: str) -> None:
    # Each pair sums, in fp32, to exactly halfway between two neighbours of the dtype.
    dtype = _numpy_dtype(dtype_name)
    if dtype_name == "bfloat16":
        a, b = [1.0, 1.0 + 2**-7, -1.0], [2**-8, 2**-8, -(2**-8)]
        want = [1.0, 1.0 + 2**-6, -1.0]
    else:
        a, b = [1.0, 1.0 + 2**-10, 65504.0], [2**-11, 2**-11, 16.0]
        want = [1.0, 1.0 + 2**-9, np.inf]  # 65520 is halfway to 2^16, whose even side is inf
    srcs = [np.array(a, np.float32).astype(dtype), np.array(b, np.float32).astype(dtype)]
    for isa in _isas():
        dst = np.empty(3, dtype)
        _kernel(dst, srcs, 3, dtype_name, isa)
        assert dst.astype(np.float64).tolist() == want, isa


def _guard_page_worker(rank: int, world: int, args: dict) -> int:
    """Reduce buffers that end right before a PROT_NONE page: an over-read or over-write faults."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    checked = 0
    maps = []

    def at_page_end(nbytes: int, dtype: np.dtype) -> np.ndarray:
        region = mmap.mmap(-1, 2 * page)
        maps.append(region)
        base = ctypes.addressof(ctypes.c_char.from_buffer(region))
        assert libc.mprotect(ctypes.c_void_p(base + page), page, 0) == 0
        return np.frombuffer(region, dtype, nbytes // dtype.itemsize, page - nbytes)

    for dtype_name in DTYPE_NAMES:
        dtype = _numpy_dtype(dtype_name)
        for count in range(1, 70):
            srcs = [at_page_end(count * dtype.itemsize, dtype) for _ in range(3)]
            for s in srcs:
                s[:] = np.arange(count, dtype=np.float32).astype(dtype)
            dst = at_page_end(count * dtype.itemsize, dtype)
            for isa in _isas():
                _kernel(dst, srcs, count, dtype_name, isa)
                checked += 1
            maps.clear()
    return checked


def test_sum_kernels_never_touch_memory_past_the_end() -> None:
    # In a child process: a fault must fail the test, not kill pytest.
    results = RankGroup(1, _guard_page_worker, {}).collect(120)
    assert results[0] > 0


# ---------------------------------------------------------------------------------------------
# World size 1 and the registry, in this process.
# ---------------------------------------------------------------------------------------------


def test_world_size_one_is_the_identity_for_numpy_and_torch() -> None:
    import torch

    from numaov.distributed.communicator import ShmCommunicator

    group = unique_name("solo")
    comm = ShmCommunicator(group, 0, 1, job_id=group, timeout_s=10)
    try:
        for x in (np.arange(10, dtype=np.float32), torch.arange(10).to(torch.bfloat16)):
            y = x.copy() if isinstance(x, np.ndarray) else x.clone()
            comm.all_reduce(y)
            comm.broadcast(y, 0)
            out = np.empty_like(y) if isinstance(y, np.ndarray) else torch.empty_like(y)
            comm.all_gather_into_tensor(out, y)
            comm.reduce_scatter_tensor(out, y)
            comm.all_to_all(out, y)
            comm.all_to_all(y, y)
            gathered = comm.all_gather(y.reshape(2, 5), 1)
            comm.barrier()
            for result in (y, out, gathered.reshape(-1)):
                assert result.tolist() == x.tolist()
        assert comm.seq == 16
    finally:
        comm.close()
    assert shm_leftovers(group) == []


@pytest.mark.parametrize(("out", "inp", "message"), [
    (np.empty(5, np.float32), np.ones(6, np.float32),
     "all_to_all: output has 5 elements and input 6; expected the same number in both"),
    (np.empty(6, np.float16), np.ones(6, np.float32),
     "all_to_all: output and input dtypes differ"),
    (np.empty(1, np.float32), np.array(1.0, np.float32), "all_to_all: input is a scalar"),
])
def test_all_to_all_refuses_buffers_before_moving_data(out: Any, inp: Any, message: str) -> None:
    # A dim 0 that world_size does not divide is refused the same way, failing the group: see
    # test_collectives_failures.py (it needs more than one rank).
    from numaov.distributed.communicator import CollectiveError, ShmCommunicator

    group = unique_name("a2a-args")
    comm = ShmCommunicator(group, 0, 1, job_id=group, timeout_s=10)
    try:
        with pytest.raises(CollectiveError, match=message):
            comm.all_to_all(out, inp)
        with pytest.raises(CollectiveError, match="failed earlier"):
            comm.barrier()
    finally:
        comm.close()
    assert shm_leftovers(group) == []


def test_registry_says_not_found_and_destroyed_in_python_and_cpp() -> None:
    from numaov.distributed.communicator import (
        CollectiveError,
        ShmCommunicator,
        destroy_communicator,
        find_communicator,
        register_communicator,
    )

    group = unique_name("registry")
    with pytest.raises(CollectiveError, match=f"'{group}' not found"):
        find_communicator(group)
    comm = ShmCommunicator(group, 0, 1, job_id=group, timeout_s=10)
    assert find_communicator(group) is comm
    register_communicator(comm)  # registering the same one again is a no-op
    assert _native().find_communicator(group).name == group  # what OpenVINO's ops see
    with pytest.raises(CollectiveError, match="already has a communicator in this process"):
        ShmCommunicator(group, 0, 1, job_id=group + "x", timeout_s=10)
    destroy_communicator(group)
    destroy_communicator(group)  # idempotent
    for find in (find_communicator, _native().find_communicator):
        with pytest.raises(CollectiveError, match="destroyed"):
            find(group)
    with pytest.raises(CollectiveError, match="destroyed"):
        comm.barrier()
    with pytest.raises(CollectiveError, match="not found"):
        destroy_communicator(unique_name("never-made"))
