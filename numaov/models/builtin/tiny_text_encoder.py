"""The smallest text side a Wan pipeline can have: a word-level tokenizer with T5's template
and a two-layer UMT5 encoder, both in the transformers classes `WanPipeline` loads. The
built-in digits pipeline ships them (the encoder seeded, untrained); the tests' tiny
pipelines build theirs the same way."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def word_tokenizer(words: Sequence[str]) -> Any:
    """A ``PreTrainedTokenizerFast`` over ``words`` (``<pad>``, ``</s>``, ``<unk>`` first, at
    ids 0, 1, 2): whitespace-split words, then the end-of-sequence token, as T5 does."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>",
                                   eos_token="</s>", unk_token="<unk>", model_max_length=512)


def tiny_umt5_encoder(vocab_size: int, d_model: int) -> Any:
    """A two-layer ``UMT5EncoderModel`` of width ``d_model``, initialised from torch's current
    random state (seed it first)."""
    from transformers import UMT5Config, UMT5EncoderModel

    return UMT5EncoderModel(UMT5Config(
        vocab_size=vocab_size, d_model=d_model, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=16,
        feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    )).eval()
