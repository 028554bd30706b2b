"""A byte-level BPE tokenizer of the tiny models' 512 ids that can spell any text, JSON included.

The tiny models' word-level tokenizer (``deepseek_harness.tiny_tokenizer``) has no ``{`` or
``"``; structured-output tests need a vocabulary in which JSON can be written. This one is
trained here, deterministically, on a fixed text (JSON documents and a few English sentences):
``<pad>`` is id 0, ``<eos>`` id 1 (the tiny models' ``eos_token_id``), then the 256 byte
symbols, then merges up to ``VOCAB``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

VOCAB = 512
EOS_ID = 1

_WORDS = ("alpha beta gamma delta red green blue small large open closed pending shipped "
          "delivered cancelled paris london tokyo berlin madrid name age city tags items "
          "status price count true false null the cat sat on a mat hello world").split()


def _corpus() -> list[str]:
    lines = []
    for i in range(120):
        word = _WORDS[i % len(_WORDS)]
        other = _WORDS[(7 * i + 3) % len(_WORDS)]
        document = {"name": f"{word} {other}", "age": (13 * i) % 90, "city": other,
                    "tags": [word, other][: 1 + i % 2], "status": _WORDS[9 + i % 5],
                    "items": [{"price": (17 * i) % 1000 / 10, "count": i % 7}],
                    "open": i % 3 == 0, "note": None}
        lines.append(json.dumps(document))
        lines.append(json.dumps(document, indent=2))
        lines.append(f"The {word} cat sat on the {other} mat, {i} times.")
    return lines


def json_tokenizer(directory: Path | None = None) -> Any:
    """The tokenizer (a ``tokenizers.Tokenizer``), saved as ``directory/tokenizer.json`` when
    a directory is given."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<pad>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(_corpus(), trainer)
    assert tokenizer.token_to_id("<eos>") == EOS_ID
    if directory is not None:
        directory.mkdir(parents=True, exist_ok=True)
        tokenizer.save(str(directory / "tokenizer.json"))
    return tokenizer
