"""The LM engine on the tiny DeepSeek-V2 in this process (PyTorch, dp=1): continuous batching,
sampling, stop rules, streaming, cancel, cache capacity; and its parts on their own
(scheduler, cache manager, sampler, text stream, settings). The batching, cancel, capacity and
arrival tests also run on a tiny Qwen3-MoE (the GQA cache layout in the same pool).

"Alone" below means the same request in a fresh engine with nothing else in it; a request run
among others must give exactly the same tokens. Greedy outputs are also checked against
``greedy_reference`` (every token recomputed from the whole sequence, no cache).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.deepseek_harness import greedy_reference, tiny_tokenizer

from numaov.models.builtin.deepseek_tiny import build_tiny_deepseek
from numaov.models.deepseek_v2 import DeepseekV2
from numaov.models.families import family_for_model_type
from numaov.runtime.lm.cache import PREFIX_BLOCK, CacheCapacityError, CacheManager
from numaov.runtime.lm.engine import (
    GenerationInputError,
    LMEngine,
    SamplingParams,
    StepModel,
    TorchStep,
)
from numaov.runtime.lm.sampler import new_generator, sample_token
from numaov.runtime.lm.scheduler import PREFIX_ROUTING_SLACK, Scheduler
from numaov.runtime.lm.sequence import Sequence
from numaov.runtime.lm.text import TextStream

SEED = 3
EOS = 1  # the tiny model's eos_token_id


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> DeepseekV2:
    print(f"tiny DeepSeek-V2 seed: {SEED}")
    return DeepseekV2.from_pretrained(build_tiny_deepseek(tmp_path_factory.mktemp("ds"), SEED))


@pytest.fixture(scope="module", params=[
    "deepseek_v2", pytest.param("qwen3_moe", marks=pytest.mark.slow)])
def any_model(request: pytest.FixtureRequest, model: DeepseekV2,
              tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The tiny DeepSeek-V2 (MLA cache), or a tiny Qwen3-MoE of the same vocabulary (GQA)."""
    if request.param == "deepseek_v2":
        return model
    from support.qwen_moe_harness import save_checkpoint

    from numaov.models.qwen_moe import QwenMoe

    _, directory = save_checkpoint(tmp_path_factory.mktemp("qwen") / "tiny", "qwen3_moe", SEED,
                                   vocab_size=512)
    return QwenMoe.from_pretrained(directory)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def _family(model: Any) -> Any:
    return family_for_model_type(model.config.to_dict()["model_type"], "the test's model")


def _engine(model: Any, step: StepModel | None = None, **options: Any) -> LMEngine:
    family = _family(model)
    return LMEngine.in_process(step or TorchStep.from_model(model, family),
                               model.config.to_dict(), family.cache_layout(model.config),
                               **options)


def _alone(model: Any, prompt: list[int], params: SamplingParams,
           tokenizer: Any = None) -> Any:
    with _engine(model, cache_tokens=1024, tokenizer=tokenizer) as engine:
        return engine.result(engine.submit(prompt, params))


class PacedStep(StepModel):
    """The tiny model's real step, run only once the test allows one more forward; lets a
    test put requests in at a known point of the others' generation."""

    name = "torch"

    def __init__(self, model: Any) -> None:
        self._inner = TorchStep.from_model(model, _family(model))
        self.allowed = threading.Semaphore(0)

    def bind_pool(self, pool: np.ndarray) -> None:
        self._inner.bind_pool(pool)

    def step(self, feeds: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        assert self.allowed.acquire(timeout=120), "the test never allowed this forward"
        return self._inner.step(feeds)

    def run_freely(self) -> None:
        for _ in range(100000):
            self.allowed.release()


# -- batching: each request as if alone -------------------------------------------------------

REQUESTS: list[tuple[list[int], SamplingParams]] = [
    ([5, 17, 99, 3, 250, 8, 41], SamplingParams(8, ignore_eos=True)),
    ([300, 2], SamplingParams(5, temperature=0.8, seed=1)),
    ([77, 12, 19, 401, 9, 9, 9, 9, 9, 9, 9], SamplingParams(7, temperature=1.2, top_k=5,
                                                              seed=2, logprobs=True)),
    ([11], SamplingParams(9, temperature=0.7, top_p=0.5, seed=3)),
    ([40, 41, 42, 43], SamplingParams(6, stop_token_ids=(24, 161, 389))),
    ([6] * 23, SamplingParams(4, temperature=1.0, seed=4, ignore_eos=True)),
    ([200, 201, 202], SamplingParams(10, temperature=0.9, seed=5, stop=("w30", "w4"))),
]


def test_concurrent_requests_each_equal_the_request_alone(any_model, tokenizer) -> None:
    with _engine(any_model, cache_tokens=512, prefill_chunk=5, tokenizer=tokenizer) as engine:
        ids = [engine.submit(p, s) for p, s in REQUESTS]
        together = [engine.result(i) for i in ids]
        assert engine.stats().cache_used_tokens == [0]
    for (prompt, params), got in zip(REQUESTS, together, strict=True):
        alone = _alone(any_model, prompt, params, tokenizer)
        assert (got.tokens, got.finish_reason, got.text) == (
            alone.tokens, alone.finish_reason, alone.text), (prompt, params)
        assert got.logprobs == pytest.approx(alone.logprobs, abs=1e-5) if params.logprobs else (
            got.logprobs is None)
    greedy, _ = greedy_reference(any_model, [REQUESTS[0][0]], 8)
    assert together[0].tokens == greedy[0] and together[0].finish_reason == "length"
    # stop ids: the stopping token is left out; the rules end each request on its own
    reference, _ = greedy_reference(any_model, [REQUESTS[4][0]], 6)
    cut = next((i for i, t in enumerate(reference[0]) if t in (24, 161, 389, EOS)), None)
    assert together[4].tokens == reference[0][:cut]
    assert together[4].finish_reason == ("stop" if cut is not None else "length")
    # logprobs: one per token, each a log-probability
    assert len(together[2].logprobs) == len(together[2].tokens)
    assert all(v <= 0 for v in together[2].logprobs)


def test_the_same_seed_gives_the_same_tokens_and_another_seed_others(model) -> None:
    prompt = [9, 8, 7]
    runs = [_alone(model, prompt, SamplingParams(12, temperature=1.0, seed=s, ignore_eos=True))
            for s in (7, 7, 8)]
    assert runs[0].tokens == runs[1].tokens
    assert runs[0].tokens != runs[2].tokens


def test_generation_config_end_ids_stop_as_in_transformers(model, tmp_path: Path) -> None:
    """transformers' generate stops at the eos_token_id of generation_config.json as well as
    the config's (a chat model's end of turn may be listed there only); so does the engine,
    reading the file an export keeps."""
    from numaov.runtime.lm.sequence import GenerationInputError, read_generation_config

    prompt = [200, 201, 202]
    free = _alone(model, prompt, SamplingParams(6, ignore_eos=True))
    assert free.tokens[2] not in free.tokens[:2]
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [model.config.eos_token_id, free.tokens[2]], "temperature": 0.6}))
    with _engine(model, generation_config=read_generation_config(tmp_path)) as engine:
        stopped = engine.result(engine.submit(prompt, SamplingParams(6)))
    assert stopped.tokens == free.tokens[:2] and stopped.finish_reason == "stop"
    assert read_generation_config(tmp_path / "absent") == {}
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": "x"}')
    with pytest.raises(GenerationInputError, match="eos_token_id 'x'; expected a token id"):
        read_generation_config(tmp_path)


def test_stop_strings_cut_the_text_before_them(model, tokenizer) -> None:
    prompt = [200, 201, 202]
    free = _alone(model, prompt, SamplingParams(10, ignore_eos=True), tokenizer)
    words = free.text.split()
    assert len(words) >= 4
    stopped = _alone(model, prompt, SamplingParams(10, ignore_eos=True, stop=(words[2],)),
                     tokenizer)
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[:free.text.index(words[2])]
    assert stopped.tokens == free.tokens[:3]


def test_streaming_yields_tokens_and_exactly_the_final_text(model, tokenizer) -> None:
    with _engine(model, cache_tokens=256, tokenizer=tokenizer) as engine:
        request = engine.submit([3, 4, 5], SamplingParams(8, temperature=0.9, seed=1))
        events = list(engine.stream(request))
        done = engine.result(request)
    assert "".join(e.text for e in events) == done.text == tokenizer.decode(done.tokens)
    assert [t for e in events for t in e.tokens] == done.tokens
    assert events[-1].finish_reason == done.finish_reason and events[-1].tokens == []
    assert all(e.finish_reason is None for e in events[:-1])


# -- cancel, cache capacity, arrivals while others run ----------------------------------------


def test_cancel_mid_generation_frees_the_cache_at_once(any_model) -> None:
    paced = PacedStep(any_model)
    with _engine(any_model, paced, cache_tokens=300) as engine:
        request = engine.submit([5, 6, 7, 8], SamplingParams(200, ignore_eos=True))
        stream = engine.stream(request)
        paced.allowed.release(3)
        first = [next(stream) for _ in range(3)]
        assert all(len(e.tokens) == 1 for e in first)
        assert engine.stats().cache_used_tokens == [204]  # prompt + every token it may make
        assert engine.cancel(request)
        assert engine.stats().cache_used_tokens == [0] and engine.stats().running == [0]
        assert [e.finish_reason for e in stream][-1] == "cancelled"
        assert engine.result(request).finish_reason == "cancelled"
        assert not engine.cancel(request)
        # the freed slots serve the next request, which is unaffected by the one before
        paced.run_freely()
        again = engine.result(engine.submit([5, 6], SamplingParams(6, ignore_eos=True)))
    assert again.tokens == greedy_reference(any_model, [[5, 6]], 6)[0][0]


def test_a_request_that_does_not_fit_now_waits_and_one_that_never_fits_is_refused(
        any_model) -> None:
    paced = PacedStep(any_model)
    first, second = ([1 + i for i in range(10)], SamplingParams(20, ignore_eos=True)), (
        [50 + i for i in range(8)], SamplingParams(20, temperature=0.8, seed=9))
    with _engine(any_model, paced, cache_tokens=40) as engine:
        with pytest.raises(CacheCapacityError, match=r"needs 45 cache slots, more than a "
                           r"rank's whole cache \(40 tokens\)"):
            engine.submit([1] * 25, SamplingParams(20))
        a = engine.submit(*first)
        b = engine.submit(*second)
        paced.allowed.release(1)
        next(engine.stream(a))
        stats = engine.stats()
        assert (stats.running, stats.queue_depth, stats.cache_used_tokens) == ([1], 1, [30])
        paced.run_freely()
        got = [engine.result(a), engine.result(b)]
    assert [g.tokens for g in got] == [_alone(any_model, *first).tokens,
                                       _alone(any_model, *second).tokens]


def test_a_long_prompt_arriving_while_others_decode_changes_nothing(any_model) -> None:
    paced = PacedStep(any_model)
    short = [([21, 22, 23], SamplingParams(14, ignore_eos=True)),
             ([31, 32], SamplingParams(14, temperature=0.9, seed=6, ignore_eos=True))]
    long = ([(7 * i) % 500 for i in range(45)], SamplingParams(5, ignore_eos=True))
    with _engine(any_model, paced, cache_tokens=512, prefill_chunk=4) as engine:
        ids = [engine.submit(*r) for r in short]
        streams = [engine.stream(i) for i in ids]
        paced.allowed.release(4)
        for s in streams:
            next(s)  # both are decoding
        late = engine.submit(*long)
        paced.run_freely()
        got = [engine.result(i) for i in [*ids, late]]
    for (prompt, params), g in zip([*short, long], got, strict=True):
        assert g.tokens == _alone(any_model, prompt, params).tokens


def test_an_idle_engine_does_not_step(model) -> None:
    with _engine(model, cache_tokens=128) as engine:
        engine.result(engine.submit([1, 2, 3], SamplingParams(5, ignore_eos=True)))
        # the prompt fits one prefill chunk: 1 step for it and the first token, 4 decodes
        assert engine.stats().steps == 5
        time.sleep(0.2)  # a busy loop would step here
        assert engine.stats().steps == 5
        assert engine.stats().tokens_per_second[0] > 0


# -- prefix cache -----------------------------------------------------------------------------

SYSTEM = [(11 * i + 3) % 500 for i in range(2 * PREFIX_BLOCK + 5)]  # a shared "system prompt"
TURNS: list[tuple[list[int], SamplingParams]] = [
    (SYSTEM + [21, 22, 23], SamplingParams(6, ignore_eos=True)),
    (SYSTEM + [31], SamplingParams(5, temperature=0.9, seed=4, ignore_eos=True, logprobs=True)),
    (SYSTEM[:PREFIX_BLOCK + 3] + [40, 41], SamplingParams(6, temperature=1.1, top_k=8, seed=5)),
    (SYSTEM + [21, 22, 23, 24], SamplingParams(4, ignore_eos=True)),
]


def _turns(model: Any, prefix_cache: bool, together: bool, **options: Any) -> list[Any]:
    with _engine(model, cache_tokens=400, prefix_cache=prefix_cache, **options) as engine:
        if together:
            ids = [engine.submit(*turn) for turn in TURNS]
            return [engine.result(i) for i in ids]
        return [engine.result(engine.submit(*turn)) for turn in TURNS]


@pytest.mark.parametrize("together", [False, True], ids=["one_after_another", "together"])
def test_prefix_cache_reads_shared_prompt_starts_and_changes_no_output(any_model,
                                                                       together: bool) -> None:
    plain = _turns(any_model, False, together, prefill_chunk=7)
    cached = _turns(any_model, True, together, prefill_chunk=7)
    for a, b in zip(plain, cached, strict=True):
        assert (a.tokens, a.finish_reason) == (b.tokens, b.finish_reason)
        if a.logprobs is not None:
            assert b.logprobs == pytest.approx(a.logprobs, abs=1e-5)
    assert [c.cached_tokens for c in plain] == [0, 0, 0, 0]
    if together:  # the first prompt's blocks are offered once it is read: the others, admitted
        # in the same step, computed theirs
        assert cached[0].cached_tokens == 0
    else:  # each later turn reads the whole blocks of what came before it
        assert [c.cached_tokens for c in cached] == [0, 2 * PREFIX_BLOCK, PREFIX_BLOCK,
                                                     2 * PREFIX_BLOCK]


def test_cancelling_one_sharer_leaves_the_blocks_the_other_reads(any_model) -> None:
    paced = PacedStep(any_model)
    first = (SYSTEM + [21], SamplingParams(40, ignore_eos=True))
    second = (SYSTEM + [77, 78], SamplingParams(8, temperature=0.8, seed=2, ignore_eos=True))
    with _engine(any_model, paced, cache_tokens=2 * len(SYSTEM) + 60) as engine:
        a = engine.submit(*first)
        stream = engine.stream(a)
        paced.allowed.release(2)
        next(stream)  # a's prompt is read and its blocks offered
        b = engine.submit(*second)
        paced.allowed.release(2)
        assert engine.cancel(a)
        paced.run_freely()
        got = engine.result(b)
        stats = engine.stats()
        assert got.cached_tokens == 2 * PREFIX_BLOCK
        assert stats.cached_prompt_tokens == [2 * PREFIX_BLOCK]
        assert stats.prompt_tokens == [len(first[0]) + len(second[0])]
        # the pool is full of cached blocks now: a request needing every slot evicts them
        full = engine.result(engine.submit([3], SamplingParams(2 * len(SYSTEM) + 59,
                                                                ignore_eos=True)))
        # the system prompt's blocks were evicted for it; its own blocks are cached now
        assert engine.stats().prefix_cache_tokens == [(2 * len(SYSTEM) + 59) // PREFIX_BLOCK
                                                      * PREFIX_BLOCK]
        again = engine.result(engine.submit(SYSTEM + [5], SamplingParams(1)))
        assert again.cached_tokens == 0
    assert got.tokens == _alone(any_model, *second).tokens
    assert full.tokens == _alone(any_model, [3], SamplingParams(2 * len(SYSTEM) + 59,
                                                                 ignore_eos=True)).tokens


# -- input checks -----------------------------------------------------------------------------


@pytest.mark.parametrize(("prompt", "params", "parameter", "message"), [
    ([], SamplingParams(2), "prompt", "prompt is empty"),
    ([1, 512], SamplingParams(2), "prompt", r"token id\(s\) \[512\] outside the vocabulary"),
    ([1] * 250, SamplingParams(10), "max_new_tokens", "max_position_embeddings=256"),
    ("abc", SamplingParams(2), "prompt", "non-integer token ids"),
    ([1], SamplingParams(2, stop_token_ids=(600,)), "stop_token_ids", "outside the vocab"),
    ([1], SamplingParams(2, stop=("x",)), "stop", "need a tokenizer"),
])
def test_bad_requests_are_one_error_naming_the_parameter(model, prompt, params, parameter,
                                                         message) -> None:
    with _engine(model, cache_tokens=64) as engine:
        with pytest.raises(GenerationInputError, match=message) as caught:
            engine.submit(prompt, params)
    assert caught.value.parameter == parameter


@pytest.mark.parametrize(("settings", "parameter"), [
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"seed": -1}, "seed"),
    ({"stop_token_ids": "12"}, "stop_token_ids"),
    ({"stop": "end"}, "stop"),
    ({"stop": ("",)}, "stop"),
])
def test_sampling_settings_are_checked(settings: dict[str, Any], parameter: str) -> None:
    with pytest.raises(GenerationInputError) as caught:
        SamplingParams(**{"max_new_tokens": 4, **settings})
    assert caught.value.parameter == parameter and "expected" in str(caught.value)


def test_engine_options_are_checked(model) -> None:
    for options, parameter in (({"cache_tokens": 0}, "cache_tokens"),
                               ({"prefill_chunk": 0}, "prefill_chunk"),
                               ({"max_running": -1}, "max_running")):
        with pytest.raises(GenerationInputError) as caught:
            _engine(model, **options)
        assert caught.value.parameter == parameter


# -- the parts --------------------------------------------------------------------------------


def _seq(request_id: int, prompt_len: int, new: int) -> Sequence:
    return Sequence(request_id, list(range(1, prompt_len + 1)), SamplingParams(new), request_id)


def test_scheduler_places_on_the_least_loaded_rank_and_steps_idle_ranks_in_lockstep() -> None:
    scheduler = Scheduler([CacheManager(100), CacheManager(100)], prefill_chunk=4)
    for i, (p, n) in enumerate([(3, 5), (9, 5), (2, 5)]):
        scheduler.add(_seq(i, p, n))
    steps = scheduler.schedule()
    assert [[j.request_id for j in s.joins] for s in steps] == [[0, 2], [1]]
    # one prefill phase on both ranks: rank 0 reads both prompts in one chunk of 4 tokens?
    # no: 3 + 2 > 4, so request 2 gets the 1 token left of the chunk
    assert [[(r.request_id, len(r.tokens), r.sample) for r in s.phases[0]] for s in steps] == [
        [(0, 3, True), (2, 1, False)], [(1, 4, False)]]
    scheduler.running[0][0].tokens.append(7)  # request 0 got its first token
    steps = scheduler.schedule()
    # a decode phase (rank 1 idle in it, with 0 rows) and the prefill phase
    assert [[[r.request_id for r in rows] for rows in s.phases] for s in steps] == [
        [[0], [2]], [[], [1]]]
    # an idle scheduler has no step
    for seq in [*scheduler.running[0].values(), *scheduler.running[1].values()]:
        scheduler.remove(seq)
    assert scheduler.schedule() is None and not scheduler.has_work()
    assert [c.used for c in scheduler.caches] == [0, 0]


def test_a_prompt_longer_than_the_chunk_is_read_over_steps_while_others_decode() -> None:
    scheduler = Scheduler([CacheManager(200)], prefill_chunk=8)
    scheduler.add(_seq(0, 2, 30))
    scheduler.schedule()
    scheduler.running[0][0].tokens.append(5)
    scheduler.add(_seq(1, 20, 4))
    phases = []
    for _ in range(3):
        steps = scheduler.schedule()
        phases.append([[(r.request_id, len(r.tokens)) for r in rows] for rows in steps[0].phases])
        scheduler.running[0][0].tokens.append(5)
    assert phases == [[[(0, 1)], [(1, 8)]], [[(0, 1)], [(1, 8)]], [[(0, 1)], [(1, 4)]]]


def test_cache_manager_slots_and_release() -> None:
    cache = CacheManager(10)
    a, _ = cache.allocate(1, 4)
    b, _ = cache.allocate(2, 6)
    assert sorted([*a, *b]) == list(range(10)) and not cache.can_hold(1)
    with pytest.raises(CacheCapacityError):
        cache.allocate(3, 1)
    assert cache.release(1) == 4 and cache.free == 4 and cache.release(1) == 0
    assert sorted(cache.allocate(3, 4)[0]) == sorted(a)


def test_prefix_blocks_are_shared_read_only_and_evicted_least_recently_used() -> None:
    block = PREFIX_BLOCK
    cache = CacheManager(6 * block)
    prompt = list(range(100, 100 + 2 * block + 3))  # two whole blocks and 3 tokens
    first, cached = cache.allocate(1, len(prompt) + 4, prompt)
    assert cached == 0 and cache.cached_prefix(prompt) == 0
    cache.publish(1, prompt)  # its prompt was read: two blocks offered
    assert cache.cached_tokens == 2 * block
    # a prompt with the same start reads both blocks in place; one that differs in the
    # second block reads only the first; the whole of a prompt is never read (its last
    # token is fed for the logits)
    second, cached = cache.allocate(2, 2 * block + 8, prompt[:2 * block] + [7, 7])
    assert cached == 2 * block and list(second[:2 * block]) == list(first[:2 * block])
    assert cache.cached_prefix(prompt[:block] + [1] * block + [2]) == block
    assert cache.cached_prefix(prompt[:2 * block]) == block
    # the first sequence leaves: the blocks the second reads stay, its own slots go back
    assert cache.release(1) == len(prompt) + 4 - 2 * block
    assert cache.used == 2 * block + 8 and cache.reusable == 0
    assert cache.release(2) == 8
    assert cache.used == 0 and cache.reusable == 2 * block
    # needing the slots evicts unread blocks, the least recently used first (a chain from
    # its end), and only as many as needed
    other = list(range(500, 500 + block + 1))
    cache.allocate(3, block + 1, other)
    cache.publish(3, other)
    cache.release(3)
    assert cache.can_hold(6 * block) and not cache.can_hold(6 * block + 1)
    cache.allocate(4, 4 * block, [1])  # 16 slots short: one block goes, the oldest chain's end
    assert (cache.cached_prefix(prompt), cache.cached_prefix(other)) == (block, block)
    cache.release(4)
    cache.allocate(5, 5 * block, [1])  # 16 more: the oldest block left, the chain's start
    assert (cache.cached_prefix(prompt), cache.cached_prefix(other)) == (0, block)
    cache.release(5)
    # without the prefix cache nothing is offered or found
    plain = CacheManager(4 * block, prefix_cache=False)
    plain.allocate(1, len(prompt), prompt)
    plain.publish(1, prompt)
    plain.release(1)
    assert plain.cached_tokens == 0 and plain.allocate(2, len(prompt), prompt)[1] == 0


def test_the_scheduler_sends_a_prompt_to_the_rank_holding_its_prefix_within_the_slack() -> None:
    block = PREFIX_BLOCK
    shared = list(range(1, 2 * block + 1))
    scheduler = Scheduler([CacheManager(1000), CacheManager(1000)], prefill_chunk=64)
    scheduler.caches[1].allocate(99, 2 * block + 1, shared + [5])
    scheduler.caches[1].publish(99, shared + [5])
    scheduler.caches[1].release(99)
    scheduler.add(Sequence(0, shared + [9, 9], SamplingParams(4), 0))
    steps = scheduler.schedule()
    assert [[j.request_id for j in s.joins] for s in steps] == [[], [0]]
    assert steps[1].joins[0].cached == 2 * block
    # it reads only the rest of its prompt
    assert [(r.request_id, r.tokens) for r in steps[1].phases[0]] == [(0, (9, 9))]
    scheduler.running[1][0].tokens.append(5)  # its first token
    # more prompts with that prefix go to rank 1 while it runs at most PREFIX_ROUTING_SLACK
    # more sequences than rank 0; then balance wins
    for i in range(1, PREFIX_ROUTING_SLACK + 2):
        scheduler.add(Sequence(i, shared + [i], SamplingParams(4), i))
    scheduler.schedule()
    assert sorted(scheduler.running[1]) == list(range(PREFIX_ROUTING_SLACK + 1))
    assert sorted(scheduler.running[0]) == [PREFIX_ROUTING_SLACK + 1]


def test_sampler_cuts_and_seeds() -> None:
    logits = np.random.default_rng(0).standard_normal(64).astype(np.float32)
    best = int(np.argmax(logits))
    assert sample_token(logits, SamplingParams(1), new_generator(0))[0] == best
    for cut in ({"top_k": 1}, {"top_p": 1e-6}):
        params = SamplingParams(1, temperature=5.0, **cut)
        assert {sample_token(logits, params, new_generator(s))[0] for s in range(20)} == {best}
    params = SamplingParams(1, temperature=1.0, top_k=3, logprobs=True)
    top3 = set(np.argsort(-logits)[:3].tolist())
    draws = [sample_token(logits, params, new_generator(s)) for s in range(50)]
    assert {t for t, _ in draws} <= top3 and len({t for t, _ in draws}) > 1
    shifted = logits - logits.max()
    expected = shifted - np.log(np.exp(shifted.astype(np.float64)).sum())
    assert all(lp == pytest.approx(expected[t], abs=1e-6) for t, lp in draws)
    g1, g2 = new_generator(4), new_generator(4)
    assert [sample_token(logits, params, g1)[0] for _ in range(10)] == [
        sample_token(logits, params, g2)[0] for _ in range(10)]


def _byte_tokenizer(directory: Path) -> Any:
    """A real byte-level tokenizer: one token per UTF-8 byte, so 'é' takes two tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


class _CountingTokenizer:
    """A real tokenizer that records how many tokens each decode is given."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.lengths = tokenizer, []

    def decode(self, ids: list[int]) -> str:
        self.lengths.append(len(ids))
        return self.tokenizer.decode(ids)


def test_text_deltas_decode_a_short_window_whatever_the_length(tmp_path) -> None:
    tokenizer = _CountingTokenizer(_byte_tokenizer(tmp_path))
    text = "naïve café ✓ " * 40
    ids = tokenizer.tokenizer.encode(text).ids
    stream = TextStream(tokenizer)
    deltas = [stream.add(ids[:i]) for i in range(1, len(ids) + 1)] + [stream.finish()]
    assert "".join(deltas) == text
    # A window spans the tokens since the last settled point: at most one character's bytes
    # (3 for '✓') plus the newest token, never the whole output.
    assert len(ids) > 500 and max(tokenizer.lengths) <= 6


def test_text_deltas_keep_the_spaces_a_window_start_would_drop() -> None:
    """A Metaspace decoder drops the leading space of whatever it decodes first; deltas taken
    as a difference of two decodes of the same window keep every space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = ["the", "cat", "sat", "on", "mat"]
    vocab = {f"\u2581{w}": i for i, w in enumerate(words)} | {"[UNK]": len(words)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    ids = tokenizer.encode("the cat sat on the mat").ids
    assert tokenizer.decode(ids[2:3]) == "sat"  # alone, a window's first word loses its space
    stream = TextStream(tokenizer)
    deltas = [stream.add(ids[:i]) for i in range(1, len(ids) + 1)] + [stream.finish()]
    assert "".join(deltas) == tokenizer.decode(ids) == "the cat sat on the mat"


def test_text_deltas_never_split_a_character_and_hold_back_a_stop_prefix(tmp_path) -> None:
    tokenizer = _byte_tokenizer(tmp_path)
    text = "héllo wörld ✓ done"
    ids = tokenizer.encode(text).ids
    assert len(ids) > len(text)  # multi-byte characters span several tokens
    stream = TextStream(tokenizer)
    deltas = [stream.add(ids[:i]) for i in range(1, len(ids) + 1)] + [stream.finish()]
    assert "".join(deltas) == text and not any("\ufffd" in d for d in deltas)
    stream = TextStream(tokenizer, stop=("✓ d",))
    deltas = []
    for i in range(1, len(ids) + 1):
        deltas.append(stream.add(ids[:i]))
        if stream.stopped:
            break
    assert "".join(deltas) == "héllo wörld " and stream.stopped
    assert not any("✓" in d for d in deltas)
