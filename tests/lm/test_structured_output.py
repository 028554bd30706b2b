"""Structured outputs: the tiny DeepSeek-V2 (random weights: its free text is not JSON) writes
JSON that validates against a schema, JSON objects, regex matches and choices when its requests
carry a GrammarSpec; constrained and unconstrained requests share batches and each equals the
request alone; the masks themselves (byte-level, raw word-level vocabularies, ids past the
tokenizer's); bad specs refused with one line naming the field; and (slow) the same through two
rank workers.

The model speaks the byte-level tokenizer of ``support.json_tokenizer`` (512 ids, as its
vocabulary). JSON requests ask for compact JSON (``any_whitespace=False``): with any whitespace
allowed, a model with random weights tends to write whitespace until ``max_new_tokens``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
from support.deepseek_harness import tiny_tokenizer
from support.json_tokenizer import EOS_ID, json_tokenizer

from numaov.models.builtin.deepseek_tiny import build_tiny_deepseek
from numaov.models.deepseek_v2 import DeepseekV2
from numaov.models.families import family_for_model_type
from numaov.runtime.lm.engine import (
    GenerationInputError,
    GrammarSpec,
    LMEngine,
    SamplingParams,
    TorchStep,
)
from numaov.runtime.lm.grammar import GrammarCompiler, mask_words
from numaov.runtime.lm.sampler import allowed_tokens, log_softmax, new_generator, sample_token

SEED = 3

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "status": {"enum": ["open", "closed", "pending"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {
                "city": {"enum": ["paris", "tokyo", "london"]},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "home": {"type": "object",
                         "properties": {"open": {"type": "boolean"}},
                         "required": ["open"]},
            },
            "required": ["city", "age", "home"],
        },
        "score": {"type": ["number", "null"]},
    },
    "required": ["name", "status", "tags", "owner"],
}


# Short documents, for the tests that run many requests.
SMALL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"status": {"enum": ["open", "closed"]},
                   "count": {"type": "integer", "minimum": 0, "maximum": 99},
                   "ok": {"type": "boolean"}},
    "required": ["status", "count", "ok"],
}


def compact(spec_schema: dict[str, Any] = SCHEMA) -> GrammarSpec:
    return GrammarSpec.json_schema(spec_schema, strict=True, any_whitespace=False)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The tiny model gains nothing from more threads, and on a busy machine torch's thread
    pool made its steps 10-100x slower (2 ms -> 20-300 ms per step, measured)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> DeepseekV2:
    print(f"tiny DeepSeek-V2 seed: {SEED}")
    return DeepseekV2.from_pretrained(build_tiny_deepseek(tmp_path_factory.mktemp("ds"), SEED))


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return json_tokenizer()


@pytest.fixture(scope="module")
def prompt(tokenizer) -> list[int]:
    return tokenizer.encode("The cat sat on the mat").ids


@pytest.fixture(scope="module")
def greedy_json(model, tokenizer, prompt) -> Any:
    """The greedy completion of ``prompt`` under SCHEMA, alone."""
    return _alone(model, tokenizer, prompt, SamplingParams(200, structured=compact()))


def _engine(model: Any, tokenizer: Any = None, **options: Any) -> LMEngine:
    family = family_for_model_type("deepseek_v2", "the test's model")
    return LMEngine.in_process(TorchStep.from_model(model, family), model.config.to_dict(),
                               family.cache_layout(model.config), tokenizer=tokenizer,
                               **options)


def _alone(model: Any, tokenizer: Any, prompt: list[int], params: SamplingParams) -> Any:
    with _engine(model, tokenizer, cache_tokens=1024) as engine:
        return engine.result(engine.submit(prompt, params))


# -- what the engine writes ---------------------------------------------------------------------


def test_json_schema_outputs_validate_where_free_text_is_not_json(model, tokenizer, prompt,
                                                                  greedy_json) -> None:
    runs = [SamplingParams(40)] + [
        SamplingParams(200, temperature=1.0, seed=seed, structured=compact()) for seed in (1, 2)]
    with _engine(model, tokenizer, cache_tokens=2048) as engine:
        free, *done = [engine.result(i) for i in [engine.submit(prompt, p) for p in runs]]
    with pytest.raises(ValueError):
        json.loads(free.text)
    texts = set()
    for got in [greedy_json, *done]:
        assert got.finish_reason == "stop", got.text
        jsonschema.validate(json.loads(got.text), SCHEMA)  # raises when it does not validate
        assert got.text == tokenizer.decode(got.tokens)
        texts.add(got.text)
    assert len(texts) == 3  # the seeds sample other documents


def test_json_object_gives_a_json_object(model, tokenizer, prompt) -> None:
    spec = GrammarSpec.json_object(any_whitespace=False)
    with _engine(model, tokenizer, cache_tokens=2048) as engine:
        ids = [engine.submit(prompt, SamplingParams(200, temperature=t, seed=s, structured=spec))
               for t, s in ((0.0, None), (0.8, 2), (0.8, 6))]
        done = [engine.result(i) for i in ids]
    assert all(d.finish_reason == "stop" for d in done), [d.text for d in done]
    objects = [json.loads(d.text) for d in done]
    assert all(isinstance(o, dict) for o in objects) and any(objects), objects


def test_regex_and_choice_are_honoured(model, tokenizer, prompt) -> None:
    pattern = r"[a-z]{3,8}@(mail|post)\.(com|org)"
    options = ["paris", "tokyo", "new york"]
    with _engine(model, tokenizer, cache_tokens=1024) as engine:
        ids = [engine.submit(prompt, SamplingParams(40, temperature=t, seed=s, structured=spec))
               for spec in (GrammarSpec.regex(pattern), GrammarSpec.choice(options))
               for t, s in ((0.0, None), (1.0, 1), (1.0, 2))]
        done = [engine.result(i) for i in ids]
    assert all(d.finish_reason == "stop" for d in done), [d.text for d in done]
    assert all(re.fullmatch(pattern, d.text) for d in done[:3]), [d.text for d in done[:3]]
    assert all(d.text in options for d in done[3:]), [d.text for d in done[3:]]


def test_constrained_and_free_requests_together_each_equal_the_request_alone(
        model, tokenizer, prompt) -> None:
    requests = [
        (prompt, SamplingParams(60, structured=compact(SMALL_SCHEMA))),
        ([5, 17, 99, 3, 250, 8, 41, 7, 7, 7], SamplingParams(12, ignore_eos=True)),
        (prompt[:3], SamplingParams(60, temperature=0.9, top_k=50, seed=7,
                                    structured=compact(SMALL_SCHEMA))),
        ([300, 2], SamplingParams(10, temperature=0.8, seed=1, logprobs=True)),
        (prompt, SamplingParams(30, temperature=1.0, top_p=0.9, seed=3, logprobs=True,
                                structured=GrammarSpec.regex(r"[a-z]{2,6}(-[0-9]{1,3})?"))),
        ([40, 41, 42, 43], SamplingParams(20, structured=GrammarSpec.choice(["yes", "no"]))),
    ]
    with _engine(model, tokenizer, cache_tokens=1024, prefill_chunk=4) as engine:
        ids = [engine.submit(p, s) for p, s in requests]
        together = [engine.result(i) for i in ids]
        assert engine.stats().cache_used_tokens == [0]
    for (p, params), got in zip(requests, together, strict=True):
        alone = _alone(model, tokenizer, p, params)
        assert (got.tokens, got.finish_reason, got.text) == (
            alone.tokens, alone.finish_reason, alone.text), params
        if params.logprobs:
            assert got.logprobs == pytest.approx(alone.logprobs, abs=1e-5)


def test_max_new_tokens_before_the_end_gives_length_and_a_prefix(model, tokenizer, prompt,
                                                                 greedy_json) -> None:
    whole = greedy_json
    cut = _alone(model, tokenizer, prompt, SamplingParams(6, structured=compact()))
    assert whole.finish_reason == "stop" and cut.finish_reason == "length"
    assert cut.tokens == whole.tokens[:6] and whole.text.startswith(cut.text)
    with pytest.raises(ValueError):
        json.loads(cut.text)


def test_a_complete_structure_ends_the_request_even_with_ignore_eos(model, tokenizer,
                                                                    prompt) -> None:
    got = _alone(model, tokenizer, prompt, SamplingParams(
        50, ignore_eos=True, structured=GrammarSpec.choice(["paris", "tokyo"])))
    assert got.finish_reason == "stop" and got.text in ("paris", "tokyo")


def test_grammars_in_lark_and_gbnf(model, tokenizer, prompt) -> None:
    lark = 'start: "(" ITEM ("," ITEM)* ")"\nITEM: /[a-z]{1,4}/'
    gbnf = 'root ::= "[" item ("," item)? "]"\nitem ::= [0-9] [0-9]?'
    with _engine(model, tokenizer, cache_tokens=1024) as engine:
        a = engine.result(engine.submit(prompt, SamplingParams(
            60, structured=GrammarSpec.grammar(lark))))
        b = engine.result(engine.submit(prompt, SamplingParams(
            60, temperature=1.0, seed=2, structured=GrammarSpec.grammar(gbnf))))
    assert a.finish_reason == "stop" and re.fullmatch(r"\([a-z]{1,4}(,[a-z]{1,4})*\)", a.text)
    assert b.finish_reason == "stop" and re.fullmatch(r"\[\d\d?(,\d\d?)?\]", b.text)


# -- refusals -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("make", "message"), [
    (lambda: GrammarSpec.json_schema({"type": "strin"}), "Invalid type: strin"),
    (lambda: GrammarSpec.json_schema({"type": "object", "properties": {"a": {"$ref": "#/no"}}}),
     "'/no' does not exist"),
    (lambda: GrammarSpec.json_schema({"type": "array", "uniqueItems": True}, strict=True),
     "Unimplemented keys"),
    (lambda: GrammarSpec.regex("a(b"), "unclosed group"),
    (lambda: GrammarSpec.grammar("root ::= missing"), "Rule 'missing' not found"),
    (lambda: GrammarSpec.grammar('start: "a" | nowhere'), "unknown name"),
])
def test_a_spec_the_library_cannot_compile_is_refused_in_one_line(
        model, tokenizer, prompt, make, message) -> None:
    with _engine(model, tokenizer) as engine:
        with pytest.raises(GenerationInputError) as caught:
            engine.submit(prompt, SamplingParams(10, structured=make()))
        assert engine.stats().queue_depth == 0 and engine.stats().running == [0]
    assert caught.value.parameter == "response_format"
    text = str(caught.value)
    assert message in text and "\n" not in text and text.startswith("cannot use "), text


@pytest.mark.parametrize(("make", "message"), [
    (lambda: GrammarSpec("xml"), "kind 'xml' is not known"),
    (lambda: GrammarSpec.json_schema("{not json"), "not valid JSON"),
    (lambda: GrammarSpec.json_schema([1, 2]), "expected a JSON Schema object"),
    (lambda: GrammarSpec.choice([]), "non-empty list"),
    (lambda: GrammarSpec.choice("abc"), "expected a list of strings"),
    (lambda: GrammarSpec.regex(""), "expected a non-empty string"),
    (lambda: GrammarSpec.from_response_format({"type": "json_schema"}), "json_schema.schema"),
    (lambda: GrammarSpec.from_response_format({"type": "yaml"}), "type 'yaml' is not known"),
    (lambda: SamplingParams(5, structured={"type": "object"}), "expected a GrammarSpec"),
])
def test_malformed_specs_are_refused_naming_the_field(make, message) -> None:
    with pytest.raises(GenerationInputError, match=re.escape(message)) as caught:
        make()
    assert caught.value.parameter == "response_format"


def test_the_field_named_is_the_callers(model, tokenizer, prompt) -> None:
    spec = GrammarSpec.json_schema({"type": "strin"}, parameter="tools")
    with _engine(model, tokenizer) as engine, pytest.raises(GenerationInputError) as caught:
        engine.submit(prompt, SamplingParams(10, structured=spec))
    assert caught.value.parameter == "tools"


def test_structured_output_needs_a_tokenizer(model, prompt) -> None:
    with _engine(model) as engine, pytest.raises(GenerationInputError,
                                                 match="needs the model's tokenizer"):
        engine.submit(prompt, SamplingParams(10, structured=GrammarSpec.json_object()))


def test_response_format_forms() -> None:
    assert GrammarSpec.from_response_format({"type": "text"}) is None
    assert GrammarSpec.from_response_format({"type": "json_object"}) == GrammarSpec.json_object()
    spec = GrammarSpec.from_response_format({"type": "json_schema", "json_schema": {
        "name": "x", "schema": SCHEMA, "strict": True}})
    assert spec == GrammarSpec.json_schema(SCHEMA, strict=True) and spec.schema == SCHEMA


# -- masks ------------------------------------------------------------------------------------


def _walk(matcher: Any, tokens: list[int]) -> None:
    for token in tokens:
        mask = matcher.next_mask()
        assert mask is not None and token in allowed_tokens(mask, matcher.vocab_size)
        assert matcher.accept(token)


def test_byte_level_masks_follow_the_schema_and_never_allow_ids_past_the_tokenizer(
        tokenizer) -> None:
    grammars = GrammarCompiler(tokenizer, 544, [EOS_ID])  # the model has 32 ids more
    document = {"name": "alpha", "status": "open", "tags": ["red", "blue"],
                "owner": {"city": "paris", "age": 41, "home": {"open": True}}, "score": None}
    tokens = tokenizer.encode(json.dumps(document, separators=(",", ":"))).ids
    matcher = grammars.matcher(compact())
    for i, token in enumerate(tokens):
        mask = matcher.next_mask()
        assert mask.dtype == np.int32 and mask.shape == (mask_words(544),)
        allowed = allowed_tokens(mask, 544)
        assert token in allowed and allowed.max() < 512 and EOS_ID not in allowed, i
        assert matcher.accept(token)
    assert matcher.done  # nothing can follow the closing brace
    assert allowed_tokens(matcher.next_mask(), 544).tolist() == [EOS_ID]
    # inside a string nearly every token may come; still none of the 32 extra ids
    inside = grammars.matcher(compact())
    _walk(inside, tokenizer.encode('{"name":"').ids)
    allowed = allowed_tokens(inside.next_mask(), 544)
    assert len(allowed) > 200 and allowed.max() < 512


def test_strict_closes_objects_and_lenient_schemas_stay_open(tokenizer) -> None:
    grammars = GrammarCompiler(tokenizer, 512, [EOS_ID])
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    comma = tokenizer.token_to_id(",")
    for strict, more in ((True, False), (False, True)):
        matcher = grammars.matcher(GrammarSpec.json_schema(schema, strict=strict,
                                                           any_whitespace=False))
        _walk(matcher, tokenizer.encode('{"a":1').ids)
        assert (comma in allowed_tokens(matcher.next_mask(), 512)) == more


def test_a_word_level_vocabulary_is_taken_as_raw_tokens(tmp_path: Path) -> None:
    words = tiny_tokenizer(tmp_path)  # 512 ids: "[UNK]", "the", "cat", "sat", ... "w511"
    grammars = GrammarCompiler(words, 520, [1])
    matcher = grammars.matcher(GrammarSpec.choice(["hello", "catsat", "w42"]))
    ids = [words.token_to_id(w) for w in ("hello", "cat", "w42")]
    assert allowed_tokens(matcher.next_mask(), 520).tolist() == sorted(ids)
    assert matcher.accept(words.token_to_id("cat"))
    assert allowed_tokens(matcher.next_mask(), 520).tolist() == [words.token_to_id("sat")]
    assert matcher.accept(words.token_to_id("sat")) and matcher.done


def test_a_structure_the_vocabulary_cannot_write_is_the_requests_error(
        model, tmp_path: Path) -> None:
    """A word-level vocabulary has no "{": a JSON object cannot start. The request ends with
    "error" and says why in ``structure_error`` (the service answers 400 then, not a worker
    failure), and the engine serves the next request."""
    words = tiny_tokenizer(tmp_path)
    prompt = [words.token_to_id(w) for w in ("the", "cat")]
    with _engine(model, words) as engine:
        done = engine.result(engine.submit(prompt, SamplingParams(
            10, structured=GrammarSpec.json_object())))
        assert done.tokens == [] and done.finish_reason == "error"
        assert done.structure_error.startswith("json_object cannot start: "), \
            done.structure_error
        free = engine.result(engine.submit(prompt, SamplingParams(3)))  # the engine goes on
        assert free.finish_reason == "length" and free.structure_error is None


def test_compiled_specs_are_kept_least_recently_used(tokenizer) -> None:
    grammars = GrammarCompiler(tokenizer, 512, [EOS_ID], cache_size=2)
    specs = [GrammarSpec.choice([f"x{i}", "y"]) for i in range(3)]
    for spec in specs:
        grammars.matcher(spec)
    assert grammars.compiled == 2
    # a spec's matchers are independent copies
    a, b = grammars.matcher(specs[2]), grammars.matcher(GrammarSpec.choice(["x2", "y"]))
    assert a.accept(tokenizer.token_to_id("y")) and a.done and not b.done


def test_the_sampler_takes_only_allowed_tokens_and_reports_the_models_logprob() -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(size=100).astype(np.float32)
    allowed = [3, 40, 77, 99]
    mask = np.zeros(mask_words(100), dtype=np.int32)
    for t in allowed:
        mask[t // 32] |= np.int32(1 << (t % 32))
    assert allowed_tokens(mask, 100).tolist() == allowed
    greedy = sample_token(logits, SamplingParams(1, logprobs=True), new_generator(0), mask)
    assert greedy[0] == allowed[int(np.argmax(logits[allowed]))]
    assert greedy[1] == pytest.approx(float(log_softmax(logits)[greedy[0]]))
    for seed in range(20):
        params = SamplingParams(1, temperature=2.0, top_k=3, top_p=0.9, seed=seed)
        assert sample_token(logits, params, new_generator(seed), mask)[0] in allowed
    with pytest.raises(ValueError, match="allows no token"):
        sample_token(logits, SamplingParams(1), new_generator(0), np.zeros(4, np.int32))


# -- two rank workers ----------------------------------------------------------------------------


@pytest.mark.slow  # rank worker processes with shared-memory collectives
def test_constrained_requests_on_both_rank_workers(deepseek_exported: dict[str, Any],
                                                   deepseek_bind: str, tokenizer,
                                                   prompt) -> None:
    requests = [
        (prompt, SamplingParams(200, structured=compact())),
        (prompt[:4], SamplingParams(200, temperature=1.0, seed=2, structured=compact())),
        ([5, 17, 99, 3], SamplingParams(8, ignore_eos=True)),
        (prompt, SamplingParams(40, structured=GrammarSpec.regex(r"[a-z]{3,8}@(a|b)\.org"))),
    ]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("NUMAOV_CPU_BIND", deepseek_bind)
        with LMEngine.start(deepseek_exported["model_dir"], "openvino", cache_tokens=1024,
                            prefill_chunk=4, tokenizer=tokenizer) as engine:
            # least-loaded admission in arrival order: rank 0 takes requests 0 and 2, rank 1
            # requests 1 and 3 (constrained requests on both)
            ids = [engine.submit(p, s) for p, s in requests]
            together = [engine.result(i) for i in ids]
            assert all(engine.stats().prompt_tokens), engine.stats().prompt_tokens
            alone = [engine.result(engine.submit(p, s)) for p, s in requests]
    for got, one in zip(together, alone, strict=True):
        assert (got.tokens, got.finish_reason) == (one.tokens, one.finish_reason)
    for got in together[:2]:
        assert got.finish_reason == "stop", got.text
        jsonschema.validate(json.loads(got.text), SCHEMA)
    assert together[3].finish_reason == "stop"
    assert re.fullmatch(r"[a-z]{3,8}@(a|b)\.org", together[3].text)
