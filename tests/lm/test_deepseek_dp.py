"""DP attention parity ladder, torch rungs: dp=1 == dp=2 over gloo == dp=2 over shared memory.

Each multi-rank run spawns two processes that load the same tiny checkpoint, each taking its
own share of the prompts, and generate greedily in lockstep; the model code is the same for
both transports (only the communicator registered under the group name differs).
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import shutil
import traceback
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from support.deepseek_harness import greedy_reference

from numaov.models.builtin.deepseek_tiny import TINY_DEEPSEEK_CONFIG, build_tiny_deepseek
from numaov.models.deepseek_v2 import (
    DataParallelGroup,
    DeepseekV2,
    ShardError,
    shard_state_dict,
)

pytestmark = pytest.mark.slow  # rank processes with shared-memory collectives

SEED = 0
MAX_NEW_TOKENS = 6
WORLD = 2
# Scenario "three": prompts of different lengths, rank 0 gets prompts 0 and 2, rank 1 prompt 1.
# Scenario "one": a single prompt, so rank 1 is idle and runs every step with an empty batch.
SCENARIOS: dict[str, list[list[int]]] = {
    "three": [[5, 17, 99, 3, 250, 8, 41], [300, 2], [77, 12, 19, 401]],
    "one": [[11, 22, 33, 44, 55]],
}
# fp32 everywhere. dp=2 sums each MLP output from two half-width partial sums (and the gloo /
# shared-memory reductions add them in their own order), so logits differ from dp=1 only by
# float32 rounding: ~1e-6 relative on logits of magnitude ~1-10. 1e-4 leaves room for that
# and is far below the gap between the top two logits the greedy choice depends on.
LOGITS_ATOL = 1e-4
LOGITS_RTOL = 1e-4
RUN_TIMEOUT_S = 150


def _share(prompts: list[list[int]], rank: int) -> list[list[int]]:
    return prompts[rank::WORLD]


def _rank_main(
    rank: int, transport: str, checkpoint: str, rendezvous: str, results: Any
) -> None:
    """One DP rank: join the group, load the shard, run every scenario, report."""
    torch.set_num_threads(1)
    group = f"deepseek-dp-{transport}"
    try:
        if transport == "gloo":
            import torch.distributed as dist

            from numaov.distributed.communicator import GlooCommunicator

            dist.init_process_group(
                "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=WORLD
            )
            comm = GlooCommunicator(group, dist.group.WORLD)
        else:
            from numaov.distributed.communicator import ShmCommunicator

            comm = ShmCommunicator(group, rank, WORLD, job_id=rendezvous, timeout_s=60)
        model = DeepseekV2.from_pretrained(
            checkpoint, dp=DataParallelGroup(group, rank, WORLD)
        )
        for name, prompts in SCENARIOS.items():
            tokens, logits = greedy_reference(model, _share(prompts, rank), MAX_NEW_TOKENS)
            # numpy pickles by value; a torch tensor would be sent as a shared fd that dies
            # with this process
            results.put((rank, name, tokens, logits.numpy()))
        comm.close()
        results.put((rank, "done", None, None))
    except BaseException:  # report anything, including a failing import, to the parent
        results.put((rank, "error", traceback.format_exc(), None))


def _run_two_ranks(transport: str, checkpoint: Path, tmp_path: Path) -> dict[str, Any]:
    """Spawn both ranks; return {scenario: (tokens, logits)} in the original prompt order."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    rendezvous = (
        str(tmp_path / f"{transport}.store") if transport == "gloo" else uuid.uuid4().hex[:12]
    )
    procs = [
        ctx.Process(target=_rank_main, args=(r, transport, str(checkpoint), rendezvous, results))
        for r in range(WORLD)
    ]
    for p in procs:
        p.start()
    got: dict[tuple[int, str], tuple[Any, Any]] = {}
    try:
        done = 0
        while done < WORLD:
            try:
                rank, name, tokens, logits = results.get(timeout=RUN_TIMEOUT_S)
            except queue.Empty:
                pytest.fail(f"{transport}: no result from the ranks within {RUN_TIMEOUT_S} s")
            if name == "error":
                pytest.fail(f"{transport}: rank {rank} failed:\n{tokens}")
            if name == "done":
                done += 1
                continue
            got[(rank, name)] = (tokens, logits)
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    merged: dict[str, Any] = {}
    for name, prompts in SCENARIOS.items():
        tokens: list[Any] = [None] * len(prompts)
        logits: list[Any] = [None] * len(prompts)
        for rank in range(WORLD):
            rank_tokens, rank_logits = got[(rank, name)]
            for j, i in enumerate(range(rank, len(prompts), WORLD)):
                tokens[i] = rank_tokens[j]
                logits[i] = torch.from_numpy(rank_logits[j])
        merged[name] = (tokens, torch.stack(logits))
    return merged


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    print(f"tiny DeepSeek-V2 seed: {SEED}")
    return build_tiny_deepseek(tmp_path_factory.mktemp("deepseek_tiny"), seed=SEED)


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> dict[str, Any]:
    """dp=1, all prompts in one batch."""
    model = DeepseekV2.from_pretrained(checkpoint)
    out = {}
    for name, prompts in SCENARIOS.items():
        out[name] = greedy_reference(model, prompts, MAX_NEW_TOKENS)
    return out


@pytest.mark.parametrize("transport", ["gloo", "shm"])
def test_dp2_matches_dp1(
    transport: str, checkpoint: Path, reference: dict[str, Any], tmp_path: Path
) -> None:
    if transport == "shm" and not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm")
    got = _run_two_ranks(transport, checkpoint, tmp_path)
    for name in SCENARIOS:
        ref_tokens, ref_logits = reference[name]
        tokens, logits = got[name]
        assert tokens == ref_tokens, f"{transport} {name}: greedy tokens differ from dp=1"
        torch.testing.assert_close(logits, ref_logits, atol=LOGITS_ATOL, rtol=LOGITS_RTOL)


def test_dp_not_dividing_the_sharded_dims_is_a_clear_error(checkpoint: Path) -> None:
    # the tiny model's sharded dims are 128 (dense MLP), 32 (experts), 64 (shared experts)
    with pytest.raises(ShardError, match=r"dp=3 does not divide .*moe_intermediate_size=32"):
        DeepseekV2.from_pretrained(checkpoint, dp=DataParallelGroup("unused", 0, 3))


def test_shards_reassemble_the_full_weights(checkpoint: Path) -> None:
    full = DeepseekV2.from_pretrained(checkpoint).state_dict()
    shards = [shard_state_dict(full, TINY_DEEPSEEK_CONFIG, r, WORLD) for r in range(WORLD)]
    for name, tensor in full.items():
        parts = [s[name] for s in shards]
        if name.endswith("experts.gate_up_proj"):  # [gate; up] halves split separately
            gates, ups = zip(*(p.chunk(2, dim=1) for p in parts), strict=True)
            rebuilt = torch.cat((torch.cat(gates, 1), torch.cat(ups, 1)), 1)
        elif parts[0].shape == tensor.shape:
            rebuilt = parts[0]
        else:
            dim = next(d for d in range(tensor.dim()) if parts[0].shape[d] != tensor.shape[d])
            rebuilt = torch.cat(parts, dim)
        assert torch.equal(rebuilt, tensor), name


@pytest.mark.parametrize("layout", ["per-expert", "stacked"])
def test_rank_load_equals_the_sliced_full_model(checkpoint: Path, tmp_path: Path,
                                                layout: str) -> None:
    # A rank's load slices the per-expert tensors before stacking them (so only its share of
    # the experts is ever copied); the result must be exactly the full model's shard.
    from safetensors.torch import save_file

    full = DeepseekV2.from_pretrained(checkpoint)
    directory = checkpoint
    if layout == "stacked":  # transformers' in-memory layout, saved as is
        directory = tmp_path / "stacked"
        directory.mkdir()
        shutil.copy(checkpoint / "config.json", directory / "config.json")
        save_file({k: v.contiguous() for k, v in full.state_dict().items()},
                  str(directory / "model.safetensors"))
    for rank in range(WORLD):
        expected = shard_state_dict(full.state_dict(), TINY_DEEPSEEK_CONFIG, rank, WORLD)
        got = DeepseekV2.from_pretrained(directory, dp=DataParallelGroup("unused", rank, WORLD))
        state = got.state_dict()
        assert state.keys() == expected.keys()
        for name, tensor in expected.items():
            assert torch.equal(state[name], tensor), name


def test_rank_model_refuses_to_save_a_shard(tmp_path: Path, checkpoint: Path) -> None:
    model = DeepseekV2.empty(TINY_DEEPSEEK_CONFIG, dp=DataParallelGroup("unused", 1, WORLD))
    with pytest.raises(ShardError, match="rank 1's shard"):
        model.save_pretrained(tmp_path / "out")

