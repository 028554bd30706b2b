"""Checkpoint tensors a model cannot take as weights are refused where they are read.

Both model families read their weights through ``numaov.models.checkpoint``. Each test builds
the builtin tiny checkpoint of a family in its real layout (diffusers for Wan, Hugging Face
for DeepSeek; one safetensors file, or shards with an index as ``save_pretrained`` writes
them), changes one tensor and loads the directory with the family's ``from_pretrained``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from numaov import NumaovError
from numaov.models.builtin.deepseek_tiny import build_tiny_deepseek
from numaov.models.builtin.wan_tiny import build_tiny_wan
from numaov.models.checkpoint import CheckpointError
from numaov.models.deepseek_v2 import WEIGHTS_INDEX_NAME, WEIGHTS_NAME, DeepseekV2
from numaov.models.wan import transformer as wan

SEED = 0


@dataclass(frozen=True)
class Family:
    build: Callable[[Path, int], Path]
    load: Callable[..., torch.nn.Module]
    weights_name: str
    index_name: str
    tensor: str  # the tensor the tests change: a plain weight, not an expert of a stack


FAMILIES = {
    "wan": Family(build_tiny_wan, wan.WanTransformer.from_pretrained, wan.WEIGHTS_NAME,
                  wan.WEIGHTS_INDEX_NAME, "blocks.1.ffn.net.0.proj.weight"),
    "deepseek": Family(build_tiny_deepseek, DeepseekV2.from_pretrained, WEIGHTS_NAME,
                       WEIGHTS_INDEX_NAME, "model.layers.0.self_attn.o_proj.weight"),
}


def _shard(directory: Path, family: Family) -> None:
    """Rewrite the single weights file as two shards plus their index."""
    tensors = load_file(str(directory / family.weights_name))
    (directory / family.weights_name).unlink()
    names = sorted(tensors)
    stem = family.weights_name.removesuffix(".safetensors")
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        shard = f"{stem}-{i + 1:05d}-of-00002.safetensors"
        save_file({name: tensors[name] for name in part}, str(directory / shard))
        weight_map.update(dict.fromkeys(part, shard))
    index = {"metadata": {}, "weight_map": weight_map}
    (directory / family.index_name).write_text(json.dumps(index), encoding="utf-8")


def _file_holding(directory: Path, family: Family, name: str) -> Path:
    index = directory / family.index_name
    if not index.is_file():
        return directory / family.weights_name
    return directory / json.loads(index.read_text())["weight_map"][name]


def _checkpoint(
    tmp_path: Path, family: Family, layout: str, change: Callable[[torch.Tensor], torch.Tensor]
) -> Path:
    """The family's tiny checkpoint in ``layout`` with ``change`` applied to family.tensor."""
    directory = family.build(tmp_path / "checkpoint", SEED)
    if layout == "sharded":
        _shard(directory, family)
    path = _file_holding(directory, family, family.tensor)
    tensors = load_file(str(path))
    tensors[family.tensor] = change(tensors[family.tensor]).contiguous()
    save_file(tensors, str(path))
    return directory


def _with_value(value: float) -> Callable[[torch.Tensor], torch.Tensor]:
    def change(tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.clone()
        tensor.view(-1)[3] = value
        return tensor

    return change


@pytest.mark.parametrize("layout", ["single", "sharded"])
@pytest.mark.parametrize(
    ("change", "found", "expected"),
    [
        (lambda t: t.to(torch.int32), "has dtype int32",
         "expected a floating-point weight (float32, bfloat16, float16, float64)"),
        (lambda t: t.to(torch.float8_e4m3fn), "has dtype float8_e4m3fn",
         "expected a floating-point weight"),
        (_with_value(float("nan")), "holds 1 NaN of", "expected finite values"),
        (_with_value(float("-inf")), "holds 1 Inf of", "expected finite values"),
    ],
    ids=["int32", "float8", "nan", "inf"],
)
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_unusable_weight_is_refused_naming_file_and_tensor(
    tmp_path: Path, name: str, layout: str, change, found: str, expected: str
) -> None:
    family = FAMILIES[name]
    directory = _checkpoint(tmp_path, family, layout, change)
    with pytest.raises(CheckpointError) as info:
        family.load(directory)
    message = str(info.value)
    path = _file_holding(directory, family, family.tensor)
    assert f"tensor {family.tensor!r} in {str(path)!r}" in message
    assert found in message
    assert expected in message
    assert isinstance(info.value, NumaovError)


@pytest.mark.parametrize("layout", ["single", "sharded"])
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_float16_weight_loads_and_its_cast_is_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, name: str, layout: str
) -> None:
    family = FAMILIES[name]
    directory = _checkpoint(tmp_path, family, layout, lambda t: t.to(torch.float16))
    stored = load_file(str(_file_holding(directory, family, family.tensor)))[family.tensor]
    with caplog.at_level(logging.INFO, logger="numaov.models.checkpoint"):
        model = family.load(directory)
    casts = _cast_messages(caplog)
    assert len(casts) == 1 and str(directory) in casts[0], casts
    assert casts[0].endswith(f": 1 tensor cast from float16 to float32: {family.tensor}")
    # float16 -> float32 is exact, so the model holds the stored values
    assert torch.equal(model.state_dict()[family.tensor], stored.float())


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_checkpoint_in_the_model_dtype_logs_no_cast(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, name: str
) -> None:
    family = FAMILIES[name]
    directory = family.build(tmp_path / "checkpoint", SEED)
    with caplog.at_level(logging.INFO, logger="numaov.models.checkpoint"):
        family.load(directory)
    assert _cast_messages(caplog) == []


def _cast_messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if " cast from " in r.getMessage()]


@pytest.mark.parametrize("in_kernel", [True, False])
def test_tensors_are_copied_as_stored_across_shards(tmp_path: Path, in_kernel: bool,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from numaov.models.checkpoint import open_safetensors_checkpoint

    if not in_kernel:  # a file system without copy_file_range: the buffered path
        def refuse(*args: object) -> int:
            raise OSError(18, "Invalid cross-device link")
        monkeypatch.setattr("os.copy_file_range", refuse)
    monkeypatch.setattr("numaov.models.checkpoint._COPY_CHUNK", 1000)  # several chunks each
    generator = torch.Generator().manual_seed(SEED)
    tensors = {"a": torch.randn(40, 30, generator=generator).to(torch.float8_e4m3fn),
               "a_scale_inv": torch.rand(1, 1, generator=generator),
               "b": torch.randn(7, 300, generator=generator).to(torch.bfloat16),
               "c": torch.randn(3, generator=generator)}
    save_file({k: tensors[k] for k in ("a", "c")}, str(tmp_path / "one.safetensors"))
    save_file({k: tensors[k] for k in ("a_scale_inv", "b")}, str(tmp_path / "two.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "one.safetensors", "c": "one.safetensors", "a_scale_inv": "two.safetensors",
        "b": "two.safetensors"}}))
    checkpoint = open_safetensors_checkpoint(tmp_path, "model.safetensors",
                                             "model.safetensors.index.json")
    out = tmp_path / "kept.safetensors"
    assert checkpoint.copy_to(["b", "a", "a_scale_inv"], out) == out.stat().st_size
    kept = load_file(str(out))
    assert sorted(kept) == ["a", "a_scale_inv", "b"]
    for name, tensor in kept.items():
        assert tensor.dtype == tensors[name].dtype
        assert torch.equal(tensor.view(torch.uint8), tensors[name].view(torch.uint8))
