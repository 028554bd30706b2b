"""The LM engine on two pinned OpenVINO rank workers (the tiny DeepSeek-V2 exported for dp=2):
requests placed on the least-loaded rank, uneven load, idle ranks stepping in lockstep, chunked
prefill, seeded sampling, cancel and cache capacity, each output checked against the same
request run alone and, for greedy ones, the PyTorch dp=1 reference (no cache at all)."""

from __future__ import annotations

from typing import Any

import pytest
from support.deepseek_harness import greedy_reference

from numaov.models.deepseek_v2 import DeepseekV2
from numaov.runtime.lm.cache import CacheCapacityError
from numaov.runtime.lm.engine import LMEngine, SamplingParams

pytestmark = pytest.mark.slow  # rank worker processes with shared-memory collectives

REQUESTS: list[tuple[list[int], SamplingParams]] = [
    ([5, 17, 99, 3, 250, 8, 41], SamplingParams(6, ignore_eos=True)),
    ([300, 2], SamplingParams(5, temperature=0.8, seed=1)),
    ([77, 12, 19, 401, 9, 9, 9, 9, 9, 9, 9], SamplingParams(7, temperature=1.2, top_k=5,
                                                              seed=2)),
    ([11], SamplingParams(8, temperature=0.7, top_p=0.5, seed=3, ignore_eos=True)),
    ([40, 41, 42, 43], SamplingParams(6, stop_token_ids=(24, 161))),
    ([6] * 23, SamplingParams(4, ignore_eos=True)),
]


@pytest.fixture(scope="module")
def engine(deepseek_exported: dict[str, Any], deepseek_bind: str):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("NUMAOV_CPU_BIND", deepseek_bind)
        with LMEngine.start(deepseek_exported["model_dir"], "openvino", cache_tokens=200,
                            prefill_chunk=4) as started:
            yield started


@pytest.fixture(scope="module")
def torch_model(deepseek_exported: dict[str, Any]) -> DeepseekV2:
    return DeepseekV2.from_pretrained(deepseek_exported["checkpoint"])


def _alone(engine: LMEngine, prompt: list[int], params: SamplingParams) -> list[int]:
    assert engine.stats().running == [0, 0]
    return engine.result(engine.submit(prompt, params)).tokens


def test_concurrent_requests_on_two_ranks_each_equal_the_request_alone(engine, torch_model
                                                                       ) -> None:
    ids = [engine.submit(p, s) for p, s in REQUESTS]
    together = [engine.result(i) for i in ids]
    assert engine.stats().cache_used_tokens == [0, 0]
    for (prompt, params), got in zip(REQUESTS, together, strict=True):
        assert got.tokens == _alone(engine, prompt, params), (prompt, params)
    for i in (0, 5):  # greedy, ignoring the end-of-sequence token: the torch reference
        assert together[i].tokens == greedy_reference(
            torch_model, [REQUESTS[i][0]], REQUESTS[i][1].max_new_tokens)[0][0]


def test_one_request_leaves_the_other_rank_idle_in_lockstep(engine, torch_model) -> None:
    before = engine.stats()
    tokens = _alone(engine, [11, 22, 33, 44, 55], SamplingParams(6, ignore_eos=True))
    after = engine.stats()
    assert tokens == greedy_reference(torch_model, [[11, 22, 33, 44, 55]], 6)[0][0]
    # 5 prompt tokens in chunks of 4: 2 prefill steps, then 5 decode steps, all one phase
    assert after.steps - before.steps == 7
    idle = [a - b for a, b in zip(after.idle_phases, before.idle_phases, strict=True)]
    assert sorted(idle) == [0, 7]


def test_uneven_load_and_a_long_prompt_arriving_while_others_decode(engine) -> None:
    short = [([21, 22, 23], SamplingParams(12, ignore_eos=True)),
             ([31, 32], SamplingParams(12, temperature=0.9, seed=6, ignore_eos=True)),
             ([41], SamplingParams(12, ignore_eos=True))]
    long = ([(7 * i) % 500 for i in range(45)], SamplingParams(4, ignore_eos=True))
    ids = [engine.submit(*r) for r in short]
    for i in ids:
        next(engine.stream(i))  # all three decoding
    assert sorted(engine.stats().running) == [1, 2]  # uneven: two on one rank, one on the other
    late = engine.submit(*long)  # goes to the less loaded rank
    got = [engine.result(i).tokens for i in [*ids, late]]
    assert got == [_alone(engine, *r) for r in [*short, long]]


def test_cancel_frees_the_cache_on_its_rank_at_once(engine) -> None:
    request = engine.submit([5, 6, 7], SamplingParams(190, ignore_eos=True))
    stream = engine.stream(request)
    next(stream)
    assert sum(engine.stats().cache_used_tokens) == 193
    assert engine.cancel(request)
    assert engine.stats().cache_used_tokens == [0, 0]
    assert [e.finish_reason for e in stream][-1] == "cancelled"
    engine.result(request)


def test_requests_wait_for_cache_and_one_larger_than_the_cache_is_refused(engine) -> None:
    with pytest.raises(CacheCapacityError, match=r"more than a rank's whole cache \(200"):
        engine.submit([1] * 150, SamplingParams(60))
    # three requests of 160 slots: one per rank at a time, the third waits for the first
    requests = [([60 + i] * 100, SamplingParams(60, ignore_eos=True)) for i in range(3)]
    ids = [engine.submit(*r) for r in requests]
    stats = engine.stats()
    got = [engine.result(i).tokens for i in ids]
    # the third cannot start before one of the first two has made its 60 tokens
    assert stats.queue_depth >= 1 and max(stats.running) <= 1
    assert got == [_alone(engine, *r) for r in requests]


def test_prompts_sharing_a_prefix_go_to_the_rank_that_holds_it(engine, torch_model) -> None:
    from numaov.runtime.lm.cache import PREFIX_BLOCK

    system = [(13 * i + 7) % 500 for i in range(2 * PREFIX_BLOCK + 8)]
    first = engine.result(engine.submit(system + [1, 2], SamplingParams(5, ignore_eos=True)))
    assert first.cached_tokens == 0
    before = engine.stats()
    holder = next(r for r in range(2) if before.prefix_cache_tokens[r] >= 2 * PREFIX_BLOCK)
    prompts = [system + [k] for k in (3, 4, 5)]
    ids = [engine.submit(p, SamplingParams(5, ignore_eos=True)) for p in prompts]
    got = [engine.result(i) for i in ids]
    after = engine.stats()
    # all three read the system prompt's blocks on the rank that holds them
    assert [g.cached_tokens for g in got] == [2 * PREFIX_BLOCK] * 3
    assert after.cached_prompt_tokens[holder] - before.cached_prompt_tokens[holder] == (
        3 * 2 * PREFIX_BLOCK)
    assert after.prompt_tokens[1 - holder] == before.prompt_tokens[1 - holder]
    # the same tokens as the PyTorch model with no cache at all
    assert [g.tokens for g in got] == greedy_reference(torch_model, prompts, 5)[0]
