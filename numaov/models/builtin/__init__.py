"""Small embedded models: seeded random checkpoints built in code (no downloads), and two
models trained here and committed with their training scripts.

- ``digits-wan/``: a Wan 2.1 text-to-video pipeline (diffusers layout) of scikit-learn's
  handwritten digits drifting in four directions (``train_digits_wan.py``).
- ``digits-wan-next-digit-lora/``: a LoRA for digits-wan that makes it draw the digit after
  the prompted one (``train_digits_lora.py``), for ``numaov export wan --lora``.
- ``tiny-moe/``: a DeepSeek-V2 MoE language model (Hugging Face layout, with its tokenizer)
  of Python's documentation (``train_tiny_moe.py``).
"""

from pathlib import Path

from numaov.models.builtin.wan_tiny import TINY_WAN_CONFIG, build_tiny_wan

DIGITS_WAN_DIR = Path(__file__).parent / "digits-wan"
TINY_MOE_DIR = Path(__file__).parent / "tiny-moe"
NEXT_DIGIT_LORA = (Path(__file__).parent / "digits-wan-next-digit-lora"
                   / "pytorch_lora_weights.safetensors")

__all__ = ["DIGITS_WAN_DIR", "NEXT_DIGIT_LORA", "TINY_MOE_DIR", "TINY_WAN_CONFIG",
           "build_tiny_wan"]
