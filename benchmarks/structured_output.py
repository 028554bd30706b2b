"""Structured outputs: xgrammar against llguidance, the two grammar libraries vLLM uses.

What the LM engine pays per constrained token is the library's mask for the sequence's
grammar state (fill a ``vocab/32``-word bitmask) plus advancing the state by the sampled token
(accept); what a new schema costs once is its compile. Both are measured here with the same
JSON schema (nested objects, an array of objects with a nested array, enums, a nullable field,
required fields) and the same byte-level BPE tokenizers, trained in this script on text found
on this machine (numaov's own ``.py`` / ``.md`` files and Python's standard library sources;
nothing is downloaded) at ``--vocab`` sizes (32k and 128k by default), with the end-of-text
token as the stop token.

Per library and vocabulary:

- ``tokenizer_s``: building the library's tokenizer object once (the engine does it once);
- ``compile_s``: the schema's compile with no cache (xgrammar ``compile_json_schema``;
  llguidance builds its parser lazily, so its figure is the matcher's construction), median
  over ``--rounds``;
- ``first_mask_s``: a fresh matcher's first mask (after the compile);
- ``mask_accept_us``: per token of a schema-valid document (its tokenizer's own encoding, then
  the stop token), fill the bitmask and accept the token; each round walks the whole document
  with a fresh matcher and its mean per token is one sample, the figure is the median over
  rounds (``mask_us``, ``accept_us`` the two parts, ``p99_token_us`` the slowest 1% of single
  tokens over all rounds).

Before timing, each library's masks are checked to allow every token of the document and,
after it, the stop token only.

The engine part (numaov's :mod:`numaov.runtime.lm.grammar`, the library kept):

- ``batch8_step_us``: one engine step's structure work for 8 constrained sequences at the
  trained vocabularies, walking the document in lockstep: 8 masks (``masks_us``: what the
  scheduler computes under the engine's lock) and 8 accepts (``accepts_us``: when the tokens
  come back), ``engine_us`` the two, plus what the masks add to the rank's 8 greedy choices
  (``rank_masked_us`` - ``rank_free_us``, on random logits); medians over rounds of the mean
  per step;
- ``tiny_engine``: the tiny DeepSeek-V2 in this process (PyTorch, 1 thread) with the tests'
  512-id byte-level tokenizer (``tests/support/json_tokenizer.py``), 8 requests at once
  (seeded sampling, compact JSON, up to 128 new tokens), constrained against the same 8
  unconstrained: the engine's own count of seconds spent on structures per step
  (``LMEngine.grammar_seconds``) and the median step time of both runs.

    .venv/bin/python -m pip install xgrammar   # the comparison only; numaov uses llguidance
    .venv/bin/python benchmarks/structured_output.py [--vocab 32000,128000] [--rounds 20]

Writes benchmarks/out/structured_output.json (trained tokenizers are kept in
benchmarks/out/structured_output/ and reused). A benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import numpy as np
from machine import cpu_model  # benchmarks/machine.py, beside this file

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
OUT = HERE / "out" / "structured_output.json"
WORK = HERE / "out" / "structured_output"
EOS = "<|endoftext|>"

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string"},
        "status": {"enum": ["pending", "paid", "shipped", "delivered", "cancelled"]},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "email": {"type": "string"},
                "tier": {"enum": ["free", "pro", "enterprise"]},
                "address": {
                    "type": "object",
                    "properties": {
                        "street": {"type": "string"},
                        "city": {"type": "string"},
                        "postcode": {"type": "string"},
                        "country": {"enum": ["DE", "FR", "GB", "US", "JP"]},
                    },
                    "required": ["street", "city", "country"],
                },
            },
            "required": ["name", "tier", "address"],
        },
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "quantity": {"type": "integer"},
                    "unit_price": {"type": "number"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                    "gift": {"type": "boolean"},
                },
                "required": ["sku", "quantity", "unit_price"],
            },
        },
        "notes": {"type": ["string", "null"]},
        "total": {"type": "number"},
    },
    "required": ["order_id", "status", "customer", "items", "total"],
}

DOCUMENT: dict[str, Any] = {
    "order_id": "ORD-2026-000417",
    "status": "shipped",
    "customer": {
        "name": "Ada Lovelace",
        "email": "ada@example.org",
        "tier": "enterprise",
        "address": {"street": "12 St James's Square", "city": "London", "postcode": "SW1Y 4JH",
                    "country": "GB"},
    },
    "items": [
        {"sku": "XEON-6980P", "quantity": 2, "unit_price": 12460.0,
         "tags": ["cpu", "server", "granite rapids"], "gift": False},
        {"sku": "DDR5-6400-64G", "quantity": 24, "unit_price": 389.95, "tags": ["memory"]},
        {"sku": "NVME-7.68T", "quantity": 4, "unit_price": 1120.5,
         "tags": ["storage", "u.2"], "gift": False},
    ],
    "notes": "Deliver to the loading dock; call the number on file before arrival.",
    "total": 40721.3,
}


# 1. tokenizers trained here -------------------------------------------------------------------


def _corpus_files() -> list[Path]:
    """numaov's .py and .md files, then the standard library's .py files (sorted: the same
    corpus on every run)."""
    files = sorted(p for pattern in ("numaov/**/*.py", "tests/**/*.py", "benchmarks/*.py",
                                     "docs/*.md", "*.md")
                   for p in ROOT.glob(pattern))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files += sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts)
    return files


def _lines(files: list[Path]):
    for path in files:
        try:
            yield from path.read_text(errors="replace").splitlines()
        except OSError:
            continue


def trained_tokenizer(vocab: int) -> Any:
    """A byte-level BPE tokenizer of ``vocab`` ids (the end-of-text token one of them),
    trained on the local corpus once and kept under ``WORK``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = WORK / f"bpe_{vocab}.json"
    if path.is_file():
        return Tokenizer.from_file(str(path))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    start = time.perf_counter()
    tokenizer.train_from_iterator(_lines(_corpus_files()), trainer)
    print(f"trained a {tokenizer.get_vocab_size()}-id byte-level BPE in "
          f"{time.perf_counter() - start:.0f} s", file=sys.stderr)
    WORK.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return tokenizer


# 2. the two libraries behind one shape ---------------------------------------------------------


def _bit(mask: np.ndarray, token: int) -> bool:
    return bool((int(mask[token // 32]) >> (token % 32)) & 1)


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, eos: int) -> None:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        self.xgr = xgr
        start = time.perf_counter()
        info = xgr.TokenizerInfo.from_huggingface(
            PreTrainedTokenizerFast(tokenizer_object=tokenizer),
            vocab_size=tokenizer.get_vocab_size(), stop_token_ids=[eos])
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self.tokenizer_s = time.perf_counter() - start
        self.vocab = tokenizer.get_vocab_size()
        self._mask = xgr.allocate_token_bitmask(1, self.vocab)
        self.mask = self._mask.numpy()[0]

    def compile(self, schema: str) -> Any:
        return self.compiler.compile_json_schema(schema, any_whitespace=True, strict_mode=True)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher: Any) -> None:
        matcher.fill_next_token_bitmask(self._mask, 0)

    def accept(self, matcher: Any, token: int) -> bool:
        return matcher.accept_token(token)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer: Any, eos: int) -> None:
        import llguidance
        import llguidance.numpy as llnp

        self.llg, self.llnp = llguidance, llnp
        start = time.perf_counter()
        self.lltok = llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=tokenizer.get_vocab_size(),
                                            eos_token=eos)
        self.tokenizer_s = time.perf_counter() - start
        self.vocab = tokenizer.get_vocab_size()
        self._mask = llnp.allocate_token_bitmask(1, self.vocab)
        self.mask = self._mask[0]

    def compile(self, schema: str) -> Any:
        grammar = self.llg.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": True})
        matcher = self.llg.LLMatcher(self.lltok, grammar, log_level=0)
        if matcher.is_error():
            raise RuntimeError(matcher.get_error())
        return grammar, matcher

    def matcher(self, compiled: Any) -> Any:
        return self.llg.LLMatcher(self.lltok, compiled[0], log_level=0)

    def fill(self, matcher: Any) -> None:
        self.llnp.fill_next_token_bitmask(matcher, self._mask, 0)

    def accept(self, matcher: Any, token: int) -> bool:
        return matcher.consume_token(token)


# 3. measuring ---------------------------------------------------------------------------------


def check_walk(lib: Any, compiled: Any, tokens: list[int], eos: int) -> None:
    """Every token of the document allowed, then the stop token and nothing else."""
    matcher = lib.matcher(compiled)
    for i, token in enumerate(tokens):
        lib.fill(matcher)
        if not _bit(lib.mask, token):
            raise RuntimeError(f"{lib.name}: token {i} ({token}) of the document is masked out")
        if not lib.accept(matcher, token):
            raise RuntimeError(f"{lib.name}: token {i} ({token}) of the document was refused")
    lib.fill(matcher)
    allowed = np.flatnonzero(np.unpackbits(lib.mask.view(np.uint8), bitorder="little")
                             [:lib.vocab])
    if allowed.tolist() != [eos]:
        raise RuntimeError(f"{lib.name}: after the document the mask allows {allowed[:8]} "
                           f"({len(allowed)} ids); expected the stop token {eos} only")


def measure(lib: Any, schema: str, tokens: list[int], eos: int, rounds: int) -> dict[str, Any]:
    compiles, firsts, per_token, masks, accepts, singles = [], [], [], [], [], []
    compiled = None
    for _ in range(rounds):
        start = time.perf_counter()
        compiled = lib.compile(schema)
        compiles.append(time.perf_counter() - start)
        matcher = lib.matcher(compiled)
        start = time.perf_counter()
        lib.fill(matcher)
        firsts.append(time.perf_counter() - start)
    check_walk(lib, compiled, tokens, eos)
    walk = [*tokens, eos]
    clock = time.perf_counter
    for _ in range(rounds):
        matcher = lib.matcher(compiled)
        fill_s = accept_s = 0.0
        for token in walk:
            t0 = clock()
            lib.fill(matcher)
            t1 = clock()
            lib.accept(matcher, token)
            t2 = clock()
            fill_s += t1 - t0
            accept_s += t2 - t1
            singles.append(t2 - t0)
        per_token.append((fill_s + accept_s) / len(walk))
        masks.append(fill_s / len(walk))
        accepts.append(accept_s / len(walk))
    return {
        "tokenizer_s": lib.tokenizer_s,
        "compile_s": statistics.median(compiles),
        "compile_s_range": [min(compiles), max(compiles)],
        "first_mask_s": statistics.median(firsts),
        "mask_accept_us": 1e6 * statistics.median(per_token),
        "mask_accept_us_range": [1e6 * min(per_token), 1e6 * max(per_token)],
        "mask_us": 1e6 * statistics.median(masks),
        "accept_us": 1e6 * statistics.median(accepts),
        "p99_token_us": 1e6 * float(np.percentile(singles, 99)),
    }


# 4. numaov's engine with the library kept -----------------------------------------------------


def batch_step(tokenizer: Any, schema: str, tokens: list[int], eos: int, rounds: int,
               batch: int = 8) -> dict[str, float]:
    """Structure work of one engine step for ``batch`` sequences walking the document, and the
    rank's greedy choice with and without the masks."""
    from numaov.runtime.lm.grammar import GrammarCompiler, GrammarSpec
    from numaov.runtime.lm.sampler import new_generator, sample_token
    from numaov.runtime.lm.sequence import SamplingParams

    vocab = tokenizer.get_vocab_size()
    grammars = GrammarCompiler(tokenizer, vocab, [eos])
    spec = GrammarSpec.json_schema(json.loads(schema))
    logits = np.random.default_rng(0).normal(size=(batch, vocab)).astype(np.float32)
    greedy, generator = SamplingParams(1), new_generator(0)
    walk = tokens
    figures: dict[str, list[float]] = {}
    clock = time.perf_counter
    for _ in range(rounds):
        matchers = [grammars.matcher(spec) for _ in range(batch)]
        mask_s = accept_s = masked_s = free_s = 0.0
        for token in walk:
            t0 = clock()
            rows = [m.next_mask() for m in matchers]
            t1 = clock()
            for i, row in enumerate(rows):
                sample_token(logits[i], greedy, generator, row)
            t2 = clock()
            for i in range(batch):
                sample_token(logits[i], greedy, generator)
            t3 = clock()
            for m in matchers:
                m.accept(token)
            t4 = clock()
            mask_s, masked_s, free_s = mask_s + t1 - t0, masked_s + t2 - t1, free_s + t3 - t2
            accept_s += t4 - t3
        n = len(walk)
        for key, value in (("masks_us", mask_s), ("accepts_us", accept_s),
                           ("rank_masked_us", masked_s), ("rank_free_us", free_s),
                           ("engine_us", mask_s + accept_s),
                           ("batch8_step_us", mask_s + accept_s + masked_s - free_s)):
            figures.setdefault(key, []).append(1e6 * value / n)
    return {"batch": batch, **{k: statistics.median(v) for k, v in figures.items()}}


def tiny_engine(rounds: int) -> dict[str, Any]:
    """8 requests on the tiny DeepSeek-V2, constrained and not."""
    import tempfile

    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    from support.json_tokenizer import json_tokenizer

    from numaov.models.builtin.deepseek_tiny import build_tiny_deepseek
    from numaov.models.deepseek_v2 import DeepseekV2
    from numaov.models.families import family_for_model_type
    from numaov.runtime.lm.engine import GrammarSpec, LMEngine, SamplingParams, TorchStep

    torch.set_num_threads(1)
    tokenizer = json_tokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        model = DeepseekV2.from_pretrained(build_tiny_deepseek(Path(tmp), 3))
    family = family_for_model_type("deepseek_v2", "the benchmark's model")
    spec = GrammarSpec.json_schema(SCHEMA, strict=True, any_whitespace=False)
    prompt = tokenizer.encode("The order, as JSON:").ids
    runs: dict[str, dict[str, list[float]]] = {"constrained": {}, "free": {}}
    for _ in range(rounds):
        for name, structured in (("constrained", spec), ("free", None)):
            with LMEngine.in_process(TorchStep.from_model(model, family), model.config.to_dict(),
                                     family.cache_layout(model.config), cache_tokens=4096,
                                     tokenizer=tokenizer) as engine:
                params = [SamplingParams(128, temperature=1.0, seed=i, ignore_eos=True,
                                         structured=structured) for i in range(8)]
                engine.generate([prompt] * 8, params[0])  # warm: first forwards
                steps_before, grammar_before = len(engine.step_seconds), engine.grammar_seconds
                ids = [engine.submit(prompt, p) for p in params]
                done = [engine.result(i) for i in ids]
                steps = engine.step_seconds[steps_before:]
                figures = runs[name]
                figures.setdefault("step_ms", []).append(1e3 * statistics.median(steps))
                figures.setdefault("grammar_us_per_step", []).append(
                    1e6 * (engine.grammar_seconds - grammar_before) / len(steps))
                figures.setdefault("tokens", []).append(sum(len(d.tokens) for d in done))
    return {name: {key: statistics.median(values) for key, values in figures.items()}
            for name, figures in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", default="32000,128000",
                        help="vocabulary sizes of the trained tokenizers, comma-separated")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--engine-rounds", type=int, default=3)
    args = parser.parse_args()
    try:
        import xgrammar
    except ImportError:
        sys.exit("benchmarks/structured_output.py measures llguidance against xgrammar, which "
                 "numaov does not install: .venv/bin/python -m pip install xgrammar")

    schema = json.dumps(_closed(SCHEMA))
    document = json.dumps(DOCUMENT)
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu_model(),
        "cores": os.cpu_count(), "rounds": args.rounds,
        "versions": {"xgrammar": getattr(xgrammar, "__version__", None) or _version("xgrammar"),
                     "llguidance": _version("llguidance")},
        "document_chars": len(document), "vocabularies": {}, "ratios": {},
    }
    for vocab in (int(v) for v in args.vocab.split(",")):
        tokenizer = trained_tokenizer(vocab)
        eos = tokenizer.token_to_id(EOS)
        tokens = tokenizer.encode(document).ids
        assert tokenizer.decode(tokens) == document
        figures = {"vocab": tokenizer.get_vocab_size(), "document_tokens": len(tokens)}
        for lib in (XGrammar(tokenizer, eos), LLGuidance(tokenizer, eos)):
            figures[lib.name] = measure(lib, schema, tokens, eos, args.rounds)
            print(f"vocab {figures['vocab']}: {lib.name} {json.dumps(figures[lib.name])}",
                  file=sys.stderr)
        figures["numaov"] = batch_step(tokenizer, schema, tokens, eos, args.rounds)
        print(f"vocab {figures['vocab']}: numaov {json.dumps(figures['numaov'])}",
              file=sys.stderr)
        x, g = figures["xgrammar"], figures["llguidance"]
        result["vocabularies"][str(vocab)] = figures
        result["ratios"][str(vocab)] = {
            "mask_accept llguidance/xgrammar": g["mask_accept_us"] / x["mask_accept_us"],
            "compile+first mask llguidance/xgrammar": (g["compile_s"] + g["first_mask_s"])
            / (x["compile_s"] + x["first_mask_s"]),
            "tokenizer llguidance/xgrammar": g["tokenizer_s"] / x["tokenizer_s"],
        }
    result["tiny_engine"] = tiny_engine(args.engine_rounds)
    engine = result["tiny_engine"]
    result["ratios"]["tiny_engine step constrained/free"] = (
        engine["constrained"]["step_ms"] / engine["free"]["step_ms"])
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2))
    print(json.dumps({"ratios": result["ratios"], "tiny_engine": engine}, indent=2))


def _closed(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object, so both libraries
    constrain the same language (xgrammar's strict mode closes objects by default, llguidance
    follows JSON Schema's default of open objects)."""
    if isinstance(schema, dict):
        closed = {k: _closed(v) for k, v in schema.items()}
        if closed.get("type") == "object":
            closed.setdefault("additionalProperties", False)
        return closed
    if isinstance(schema, list):
        return [_closed(v) for v in schema]
    return schema


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


if __name__ == "__main__":
    main()
