"""LoRAs merged into the Wan transformer (numaov.models.wan.lora): every layout diffusers' Wan
loader reads, merged to the very weights diffusers' ``load_lora_weights`` + ``fuse_lora``
give, and the refusals. PyTorch only, on a tiny transformer: the export of a merged model is
tests/wan/test_wan_lora_pipeline.py."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from support.wan_harness import cli_refusal
from support.wan_lora_harness import (
    diffusers_fused,
    musubi_lora,
    peft_lora,
    save_tiny_transformer,
    wan_lora,
)
from support.wan_pipeline_harness import one_line_error

from numaov.exporter.wan_export import WanExportError, export_wan
from numaov.models.wan.lora import LoraError, LoraSpec, read_lora
from numaov.models.wan.transformer import WanTransformer

pytest.importorskip("peft")  # diffusers' load_lora_weights, the reference, needs it



@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_transformer(tmp_path_factory.mktemp("wan_lora") / "transformer", seed=0)


def _merged(checkpoint: Path, loras: list[tuple[Path, float]]) -> dict[str, torch.Tensor]:
    model = WanTransformer.from_pretrained(
        checkpoint, loras=[read_lora(LoraSpec(path, scale)) for path, scale in loras])
    return model.state_dict()  # diffusers' names and channel order


def _assert_fused_like_diffusers(checkpoint: Path, loras: list[tuple[Path, float]]) -> int:
    """numaov's merged weights equal diffusers' fused ones; returns how many changed."""
    ours = _merged(checkpoint, loras)
    reference = diffusers_fused(checkpoint, loras).state_dict()
    base = WanTransformer.from_pretrained(checkpoint).state_dict()
    assert ours.keys() == reference.keys()
    changed = 0
    for name, tensor in ours.items():
        # The same f32 operations in the same order as PEFT's merge (B @ A, times alpha / r,
        # times the scale, added to W) on the same tensors: bit for bit.
        assert torch.equal(tensor, reference[name]), name
        changed += not torch.equal(tensor, base[name])
    return changed


def test_diffusers_layout_with_alpha_and_scale(checkpoint: Path, tmp_path: Path) -> None:
    lora = peft_lora(tmp_path / "peft.safetensors", seed=1, rank=4, alpha=8)
    assert read_lora(LoraSpec(lora)).layers["blocks.0.attn1.to_q"].scaling == 2.0  # 8 / 4
    # 2 blocks x 10 linear layers, weights and biases untouched.
    assert _assert_fused_like_diffusers(checkpoint, [(lora, 0.7)]) == 20


def test_rank_and_alpha_patterns_and_rslora(checkpoint: Path, tmp_path: Path) -> None:
    lora = peft_lora(tmp_path / "patterns.safetensors", seed=2, rank=4, alpha=6,
                     rank_pattern={"blocks.1.ffn.net.2": 1}, alpha_pattern={"to_k": 3},
                     use_rslora=True)
    read = read_lora(LoraSpec(lora))
    assert read.layers["blocks.1.ffn.net.2"].down.shape[0] == 1  # rank 1 where the pattern says
    assert math.isclose(read.layers["blocks.0.attn1.to_k"].scaling, 3 / 2)  # 3 / sqrt(4)
    assert math.isclose(read.layers["blocks.1.ffn.net.2"].scaling, 6.0)  # 6 / sqrt(1)
    _assert_fused_like_diffusers(checkpoint, [(lora, 1.3)])


def test_no_metadata_means_alpha_is_rank_and_some_blocks_only(checkpoint: Path,
                                                              tmp_path: Path) -> None:
    lora = peft_lora(tmp_path / "bare.safetensors", seed=3, rank=3, alpha=12, metadata=False,
                     targets=["blocks.1.attn1.to_q", "blocks.1.attn2.to_v", "blocks.1.ffn.net.2"])
    read = read_lora(LoraSpec(lora))
    assert sorted(read.layers) == ["blocks.1.attn1.to_q", "blocks.1.attn2.to_v",
                                   "blocks.1.ffn.net.2"]
    assert {u.scaling for u in read.layers.values()} == {1.0}  # diffusers: lora_alpha = r
    assert _assert_fused_like_diffusers(checkpoint, [(lora, 1.0)]) == 3


@pytest.mark.parametrize(("rank", "alpha", "dtype"), [(4, 2.0, torch.float32), (1, 16.0,
                                                      torch.bfloat16), (3, None, torch.float16)])
def test_original_wan_layout(checkpoint: Path, tmp_path: Path, rank: int, alpha: float | None,
                             dtype: torch.dtype) -> None:
    # Only block 1, alpha below, above and absent (no scaling), the file in f32 / bf16 / f16.
    lora = wan_lora(tmp_path / "wan.safetensors", seed=4, rank=rank, alpha=alpha, blocks=[1],
                    dtype=dtype)
    assert _assert_fused_like_diffusers(checkpoint, [(lora, 0.5)]) == 10


def test_lightx2v_layout_with_biases_and_head(checkpoint: Path, tmp_path: Path) -> None:
    lora = wan_lora(tmp_path / "lightx2v.safetensors", seed=5, rank=4, alpha=4.0,
                    lightx2v=True, dtype=torch.bfloat16)
    read = read_lora(LoraSpec(lora))
    assert read.layers["blocks.0.attn1.to_q"].bias is not None  # diff_b
    assert "proj_out" in read.layers  # the head's full diff, as lora_A with an identity lora_B
    # 20 weights, their 20 biases, proj_out's weight and bias.
    assert _assert_fused_like_diffusers(checkpoint, [(lora, 1.0)]) == 42


def test_musubi_layout(checkpoint: Path, tmp_path: Path) -> None:
    lora = musubi_lora(tmp_path / "musubi.safetensors", seed=6, rank=2, alpha=1.0)
    assert _assert_fused_like_diffusers(checkpoint, [(lora, 0.9)]) == 20


def test_two_loras_stacked(checkpoint: Path, tmp_path: Path) -> None:
    first = wan_lora(tmp_path / "a.safetensors", seed=7, blocks=[0])
    second = peft_lora(tmp_path / "b.safetensors", seed=8, rank=2, alpha=4)
    _assert_fused_like_diffusers(checkpoint, [(first, 0.8), (second, -0.4)])


def test_merge_then_forward_matches_diffusers(checkpoint: Path, tmp_path: Path) -> None:
    lora = wan_lora(tmp_path / "l.safetensors", seed=9, lightx2v=True)
    ours = WanTransformer.from_pretrained(checkpoint, loras=[read_lora(LoraSpec(lora, 0.6))])
    reference = diffusers_fused(checkpoint, [(lora, 0.6)])
    generator = torch.Generator().manual_seed(0)
    inputs = (torch.randn(1, 16, 2, 4, 6, generator=generator), torch.tensor([700.0]),
              torch.randn(1, 7, 32, generator=generator))
    with torch.no_grad():
        got, expected = ours(*inputs), reference(*inputs, return_dict=False)[0]
    # numaov's model matches diffusers' to ~1e-6 per forward (tests/wan/test_wan_model.py).
    assert float((got - expected).abs().max()) <= 1e-5 * float(expected.abs().max())


# -- refusals ---------------------------------------------------------------------------------


def test_spec_parsing() -> None:
    assert LoraSpec.parse("a/b.safetensors") == LoraSpec(Path("a/b.safetensors"), 1.0)
    assert LoraSpec.parse("a/b.safetensors:0.75") == LoraSpec(Path("a/b.safetensors"), 0.75)
    assert LoraSpec.parse("c:d.safetensors") == LoraSpec(Path("c:d.safetensors"), 1.0)
    with pytest.raises(LoraError, match="scale nan; expected a finite number"):
        LoraSpec.parse("b.safetensors:nan")


def test_bad_files_are_refused(checkpoint: Path, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    with pytest.raises(LoraError, match="LoRA file .* not found"):
        read_lora(LoraSpec(tmp_path / "missing.safetensors"))
    (tmp_path / "lora.ckpt").write_bytes(b"PK\x03\x04 a pickle, not safetensors")
    with pytest.raises(LoraError, match="is not a safetensors file"):
        read_lora(LoraSpec(tmp_path / "lora.ckpt"))

    # A LoRA of another model: its keys name no layer of the transformer.
    other = tmp_path / "other.safetensors"
    save_file({"transformer.mid_block.proj.lora_A.weight": torch.zeros(4, 24),
               "transformer.mid_block.proj.lora_B.weight": torch.zeros(24, 4),
               "transformer.blocks.0.attn1.to_q.lora_A.weight": torch.zeros(4, 24),
               "transformer.blocks.0.attn1.to_q.lora_B.weight": torch.zeros(24, 4)}, str(other))
    with pytest.raises(LoraError, match=r"1 of 2 adapted layers \(4 keys after diffusers' Wan "
                       r"LoRA conversion\) match .* 1 name no linear layer of it \(e\.g\. "
                       "mid_block.proj"):
        _merged(checkpoint, [(other, 1.0)])
    # Keys of no Wan layout at all.
    save_file({"unet.down.lora_A.weight": torch.zeros(2, 2)}, str(tmp_path / "unet.safetensors"))
    with pytest.raises(LoraError, match="0 of 1 keys .* are the transformer's"):
        read_lora(LoraSpec(tmp_path / "unet.safetensors"))
    # A LoRA for a wider model: the names match, the shapes do not.
    wide = tmp_path / "wide.safetensors"
    save_file({"transformer.blocks.0.attn1.to_q.lora_A.weight": torch.zeros(4, 48),
               "transformer.blocks.0.attn1.to_q.lora_B.weight": torch.zeros(48, 4)}, str(wide))
    with pytest.raises(LoraError, match=r"0 of 1 adapted layers .* 1 do not fit its shapes "
                       r"\(e\.g\. blocks\.0\.attn1\.to_q \(lora_B \[48, 4\] @ lora_A \[4, 48\]; "
                       r"the layer is \[24, 24\]\)"):
        _merged(checkpoint, [(wide, 1.0)])
    # Not LoRA weights, and a LoRA with only half of a layer.
    save_file({"transformer.blocks.0.attn1.to_q.weight": torch.zeros(24, 24)},
              str(tmp_path / "full.safetensors"))
    with pytest.raises(LoraError, match="1 are not LoRA weights"):
        read_lora(LoraSpec(tmp_path / "full.safetensors"))
    save_file({"transformer.blocks.0.attn1.to_q.lora_A.weight": torch.zeros(4, 24)},
              str(tmp_path / "half.safetensors"))
    with pytest.raises(LoraError, match="has lora_A.weight only; expected both"):
        read_lora(LoraSpec(tmp_path / "half.safetensors"))
    save_file({"transformer.blocks.0.attn1.to_q.lora_A.weight": torch.zeros(4, 24),
               "transformer.blocks.0.attn1.to_q.lora_B.weight": torch.full((24, 4), math.nan)},
              str(tmp_path / "nan.safetensors"))
    with pytest.raises(LoraError, match="lora_B.weight is not finite floats"):
        read_lora(LoraSpec(tmp_path / "nan.safetensors"))


def test_lora_2_needs_a_second_expert(checkpoint: Path, tmp_path: Path) -> None:
    lora = peft_lora(tmp_path / "l.safetensors", seed=1)
    with pytest.raises(WanExportError, match="has no second transformer"):
        export_wan(checkpoint, tmp_path / "out", loras_2=[LoraSpec(lora)])
    assert not (tmp_path / "out").exists()


def test_cli_refusals_are_one_line(checkpoint: Path, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    def export(*args: str) -> subprocess.CompletedProcess:
        return cli_refusal("export", "wan", "--checkpoint", str(checkpoint), "--out",
                           str(tmp_path / "out"), *args)

    (tmp_path / "junk.safetensors").write_text("not a safetensors file")
    one_line_error(export("--lora", str(tmp_path / "junk.safetensors")),
                   "--lora: LoRA file", "is not a safetensors file")
    wide = tmp_path / "wide.safetensors"
    save_file({"transformer.blocks.0.attn1.to_q.lora_A.weight": torch.zeros(4, 48),
               "transformer.blocks.0.attn1.to_q.lora_B.weight": torch.zeros(48, 4)}, str(wide))
    one_line_error(export("--lora", f"{wide}:0.5"), "--lora: LoRA", "0 of 1 adapted layers",
                   "do not fit")
    one_line_error(export("--lora", f"{wide}:inf"), "argument --lora", "scale inf")
    one_line_error(export("--lora-2", str(wide)), "--lora-2:", "has no second transformer")
    two = tmp_path / "two"  # a two-expert pipeline's layout, the refusal named by its flag
    save_tiny_transformer(two / "transformer_2", seed=1)
    shutil.copytree(checkpoint, two / "transformer")
    (two / "model_index.json").write_text(json.dumps(
        {"_class_name": "WanPipeline", "boundary_ratio": 0.875,
         **{c: ["x", "y"] for c in ("transformer", "transformer_2", "text_encoder", "vae",
                                    "tokenizer", "scheduler")}}))
    for component in ("text_encoder", "vae", "tokenizer", "scheduler"):
        (two / component).mkdir()
    one_line_error(cli_refusal("export", "wan", "--checkpoint", str(two), "--out",
                               str(tmp_path / "out"), "--lora-2", str(wide)),
                   "--lora-2: LoRA", "do not fit", "transformer_2")
    assert not (tmp_path / "out").exists()
