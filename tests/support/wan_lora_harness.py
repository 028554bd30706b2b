"""LoRA files for a tiny Wan transformer in each layout diffusers' Wan loader reads, and
diffusers' own fused model to compare with.

- ``peft_lora``: diffusers' layout, made by PEFT (``add_adapter(LoraConfig)``, random weights)
  and saved by ``WanPipeline.save_lora_weights`` with the ``LoraConfig`` as
  ``lora_adapter_metadata`` (or without it: alpha is then the rank);
- ``wan_lora``: the original Wan layout (``diffusion_model.blocks.N.self_attn.q.lora_down``
  with ``.alpha``), and lightx2v's variant of it (``lora_A`` / ``lora_B``, the biases as
  ``.diff_b``, the head as a full ``.diff``, the norms' zero ``.diff`` that diffusers drops);
- ``musubi_lora``: musubi-tuner's kohya-style ``lora_unet_blocks_N_self_attn_q.lora_down``
  with ``.alpha``, every block (diffusers' converter requires them all).

``diffusers_fused`` loads them into diffusers' ``WanTransformer3DModel`` with
``WanPipeline.load_lora_weights`` + ``fuse_lora(lora_scale=...)`` + ``unload_lora_weights``
(which keeps the fused weights), one after the other: the reference numaov's merge is
compared with.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

TEXT_DIM = 32
DIM = 24  # 2 heads x 12
FFN = 64
LAYERS = 2
# The layers diffusers' Wan LoRAs adapt, per block (diffusers' module names).
BLOCK_LINEARS = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q",
                 "attn2.to_k", "attn2.to_v", "attn2.to_out.0", "ffn.net.0.proj", "ffn.net.2")
# Original Wan names of the same layers (diffusers' _convert_non_diffusers_wan_lora_to_diffusers).
WAN_NAMES = {"attn1": "self_attn", "attn2": "cross_attn", "to_q": "q", "to_k": "k", "to_v": "v",
             "to_out.0": "o", "ffn.net.0.proj": "ffn.0", "ffn.net.2": "ffn.2"}


def tiny_transformer(seed: int = 0) -> torch.nn.Module:
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16,
        out_channels=16, text_dim=TEXT_DIM, freq_dim=32, ffn_dim=FFN, num_layers=LAYERS,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=1024,
    ).eval()


def save_tiny_transformer(directory: Path, seed: int = 0) -> Path:
    tiny_transformer(seed).save_pretrained(directory)
    return directory


def _shape(module: str, dim: int = DIM) -> tuple[int, int]:
    """(out, in) of a block linear layer."""
    if module == "ffn.net.0.proj":
        return FFN, dim
    if module == "ffn.net.2":
        return dim, FFN
    return dim, dim


def peft_lora(path: Path, seed: int, rank: int = 4, alpha: float | None = 8,
              targets: Sequence[str] = ("to_q", "to_k", "to_v", "to_out.0", "net.0.proj",
                                        "net.2"),
              metadata: bool = True, **config: object) -> Path:
    """diffusers' layout, saved by ``WanPipeline.save_lora_weights`` from a PEFT adapter."""
    from diffusers import WanPipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    maker = tiny_transformer(seed + 100)
    lora_config = LoraConfig(r=rank, lora_alpha=rank if alpha is None else alpha,
                             target_modules=list(targets), init_lora_weights=False, **config)
    torch.manual_seed(seed)
    maker.add_adapter(lora_config)
    layers = get_peft_model_state_dict(maker)
    WanPipeline.save_lora_weights(
        path.parent, transformer_lora_layers=layers, weight_name=path.name,
        transformer_lora_adapter_metadata=lora_config.to_dict() if metadata else None)
    return path


def wan_lora(path: Path, seed: int, rank: int = 4, alpha: float | None = 2.0,
             blocks: Sequence[int] = range(LAYERS), dtype: torch.dtype = torch.float32,
             lightx2v: bool = False) -> Path:
    """The original Wan layout (``lora_down`` / ``lora_up`` / ``alpha``), or lightx2v's
    (``lora_A`` / ``lora_B``, ``diff_b`` biases, the head's full ``diff``, zero norm diffs)."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    down, up = ("lora_A", "lora_B") if lightx2v else ("lora_down", "lora_up")
    tensors = {}
    for block in blocks:
        for module in BLOCK_LINEARS:
            attn, _, proj = module.partition(".")
            name = (f"blocks.{block}.{WAN_NAMES[module]}" if module.startswith("ffn")
                    else f"blocks.{block}.{WAN_NAMES[attn]}.{WAN_NAMES[proj]}")
            out, inner = _shape(module)
            tensors[f"{name}.{down}.weight"] = torch.randn(rank, inner, generator=generator)
            tensors[f"{name}.{up}.weight"] = torch.randn(out, rank, generator=generator)
            if alpha is not None:
                tensors[f"{name}.alpha"] = torch.tensor(alpha)
            if lightx2v:
                tensors[f"{name}.diff_b"] = torch.randn(out, generator=generator) * 0.1
        if lightx2v:  # diffusers drops the norms' diffs (zeros in the released files)
            tensors[f"blocks.{block}.norm3.diff"] = torch.zeros(DIM)
            tensors[f"blocks.{block}.norm3.diff_b"] = torch.zeros(DIM)
    if lightx2v:  # the head as a full-weight difference with its bias (Wan2.2-Distill-Loras)
        out = 16 * 4
        tensors["head.head.diff"] = torch.randn(out, DIM, generator=generator) * 0.05
        tensors["head.head.diff_b"] = torch.randn(out, generator=generator) * 0.05
    save_file({f"diffusion_model.{k}": v.to(dtype).contiguous() for k, v in tensors.items()},
              str(path))
    return path


def musubi_lora(path: Path, seed: int, rank: int = 2, alpha: float = 1.0) -> Path:
    """musubi-tuner's kohya-style layout, every layer of every block (as its converter needs)."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for block in range(LAYERS):
        for module in BLOCK_LINEARS:
            attn, _, proj = module.partition(".")
            name = (f"blocks_{block}_{WAN_NAMES[module].replace('.', '_')}"
                    if module.startswith("ffn")
                    else f"blocks_{block}_{WAN_NAMES[attn]}_{WAN_NAMES[proj]}")
            out, inner = _shape(module)
            tensors[f"lora_unet_{name}.lora_down.weight"] = torch.randn(rank, inner,
                                                                        generator=generator)
            tensors[f"lora_unet_{name}.lora_up.weight"] = torch.randn(out, rank,
                                                                      generator=generator)
            tensors[f"lora_unet_{name}.alpha"] = torch.tensor(alpha)
    save_file(tensors, str(path))
    return path


def diffusers_fused(checkpoint: Path, loras: Sequence[tuple[Path, float]]) -> torch.nn.Module:
    """diffusers' transformer from ``checkpoint`` with each LoRA loaded by
    ``WanPipeline.load_lora_weights`` and fused with its scale, in order."""
    from diffusers import WanPipeline, WanTransformer3DModel

    transformer = WanTransformer3DModel.from_pretrained(checkpoint).eval()
    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=None, scheduler=None,
                       transformer=transformer)
    for path, scale in loras:
        pipe.load_lora_weights(str(path))
        pipe.fuse_lora(lora_scale=scale)
        # The LoRA layers go, the fused weights stay: the next LoRA fuses on top of them (a
        # second adapter loaded beside a fused one would unmerge it).
        pipe.unload_lora_weights()
    return transformer
