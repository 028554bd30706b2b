"""The export manifest: what an exported model directory holds and how it was made.

``manifest.json`` is the contract between the exporter (which writes it) and the runtime
(which reads it). Both import this module, so every field is named once, here; it is a
leaf (it imports nothing of numaov's but the base error), see ``docs/architecture.md``.

Fields:

- ``format_version``: bumped when a field changes meaning; readers refuse other versions.
- ``kind``: what the export is, which picks the runtime pipeline (``"wan"``, ``"wan-pipeline"``,
  ``"lm"`` and the pipeline components' kinds); readers say which kind they expect.
- ``family`` and ``cache_layout``: for a language model (kind ``"lm"``), the model family's name
  (``numaov.models.families``, e.g. ``"deepseek_v2"``) and its per-layer KV-cache entry
  (``{"kind", "layers", "width", "parts": [[name, values], ...], "dtype"}``), which the
  runtime's cache pool is shaped by; ``dtype`` is the pool's element type, the graph's
  ``kv_cache`` input (``"bf16"`` in bf16 exports, else ``"f32"``; absent: ``"f32"``, as every
  export before the field). Null for other kinds.
- ``config``: the model's configuration (diffusers / Hugging Face key names).
- ``inputs`` / ``outputs``: name, dtype and shape of every graph tensor; a shape entry is an
  int for a static axis or a string naming a dynamic axis (the ``torch.export.Dim`` name or
  an expression of it such as ``"2*height_patches"``).
- ``precision``: ``"f32"`` or ``"bf16"``; ``inference_precision`` is the OpenVINO
  ``INFERENCE_PRECISION_HINT`` the runtime must compile the IR with.
- ``weights``: the format the IR stores its weights in, ``WEIGHT_FORMATS`` (``"f32"``,
  ``"bf16"``, ``"int8"``, ``"int4"``; language-model exports: the routed experts in numaov's MoE op
  and, for int8 / int4, the other layers through NNCF); ``weights_group_size`` the int4 scale
  group (values per scale; null: one scale per output channel). Null in exports from before
  the field (and in Wan exports): the weights are in ``precision``.
- ``lowering``: how the fallback ops were written into ONNX (``"decomposed"`` / ``"opset23"``).
- ``timestep``: for a Wan model, ``"scalar"`` (input ``timestep [batch]``) or ``"per-frame"``
  (``[batch, frame_patches]``, Wan 2.2 TI2V); the sampler feeds that form. Null for other kinds.
- ``world_size`` and ``ranks``: one entry per rank with the ONNX and IR paths relative to the
  model directory (a single-rank model has one entry, rank 0).
- ``files``: size and xxh3-128 digest of every file the export wrote (paths relative to the
  model directory); the runtime checks a graph's files against them before compiling it, so
  a truncated or corrupt ``model.bin`` is named as such instead of failing inside OpenVINO.
- ``versions``: torch / onnx / onnxruntime / openvino / numaov at export time.
- ``parity``: the figures of the export-time parity check; ``parity_attention`` is the
  attention kernel OpenVINO ran in it (``"numaov"`` or ``"openvino"``, see
  ``numaov.custom_ops.compile_ir``), so a bf16 export's figures say which kernel they measured.
- ``source_checkpoint``: absolute path of the checkpoint exported, for the PyTorch backend.
- ``export_seconds``: how long each export stage took (load, ONNX export, conversion, parity).
- ``reference_sample``: an ``.npz`` (relative path) with one parity input set (``input.<name>``)
  and PyTorch's output on it (``output.<name>``): a model directory can re-check any backend
  against the export, and the PyTorch backend checks that the source checkpoint is unchanged.
- ``collective_group``: for a model exported for several ranks, the group name written into its
  ``numaov.collective`` nodes; the runtime creates its communicators under that name.
- ``kept_aside``: a language model's checkpoint tensors the model does not run but the export
  keeps, as stored, by their use -> file (``multi_token_prediction`` ->
  ``multi_token_prediction.safetensors`` for DeepSeek-V3's MTP layers); empty when none.
- ``notes``: what the export did not check and why (e.g. ONNX Runtime cannot run collectives).
- ``components``: for a pipeline export (kind ``"wan-pipeline"``), the subdirectories that hold
  one exported graph each, with its own ``manifest.json`` (inputs, ranks, parity, files):
  ``text_encoder``, ``transformer``, ``transformer_2``, ``vae_decoder/first_frame``, ... (names as
  in the diffusers pipeline directory). A pipeline manifest has no ``ranks`` of its own; its
  ``files`` are the ones beside the components (tokenizer, scheduler config, model index).
  Empty for a single graph.
- ``loras``: for a Wan transformer (and its pipeline), the LoRA adapters merged into its
  weights before export, in order: ``file`` (name), ``path`` (absolute, for the PyTorch
  backend, which merges them again), ``xxh3_128``, ``scale`` and ``layers`` adapted; a
  pipeline's entries also name their ``component``. Empty when none.
- ``source_digest``: for an exported Wan graph, the xxh3-128 of what it was exported from
  (the checkpoint directory's files, the export options, the versions; ``exporter.reuse``), by
  which ``export wan --reuse`` takes it into a later export. Null in other exports.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from numaov import NumaovError

logger = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = 3
PRECISIONS = ("f32", "bf16")
# A language model's KV-cache pool: element type -> bytes per value (``CacheLayout.dtype``).
CACHE_DTYPES = {"f32": 4, "bf16": 2}
WEIGHT_FORMATS = ("f32", "bf16", "int8", "int4", "fp8")
# How the fallback ops are written into ONNX (numaov.custom_ops.fallback_onnx).
LOWERINGS = ("decomposed", "opset23")
TIMESTEP_KINDS = ("scalar", "per-frame")
# A language model of any family (the family is its own field).
LM_KIND = "lm"
ATTENTION_KERNELS = ("numaov", "openvino")
# A pipeline export's kind: its components are exported graphs in subdirectories.
PIPELINE_KIND = "wan-pipeline"
# The diffusers class of an image-to-video pipeline directory (its model_index.json, which a
# pipeline export keeps in its config): the exporter adds its encoder graphs, the runtime
# asks it for an image.
IMAGE_TO_VIDEO_CLASS = "WanImageToVideoPipeline"
# A Wan pipeline export's components: subdirectory (named as in diffusers' pipeline directory)
# and the kind of the manifest there. transformer_2 (Wan 2.2 A14B's second expert) is optional.
TEXT_ENCODER_KIND = "umt5-encoder"
VAE_FIRST_FRAME_KIND = "wan-vae-decoder-first-frame"
VAE_NEXT_FRAME_KIND = "wan-vae-decoder-next-frame"
# The VAE encoder on one image (Wan 2.2 TI2V's image-to-video; only pipelines with
# expand_timesteps have it).
VAE_ENCODER_KIND = "wan-vae-encoder-image"
# The VAE encoder on each later chunk of 4 frames, with the first chunk's caches (Wan 2.1 /
# 2.2 I2V A14B encode the image followed by zero frames; only their exports have it).
VAE_ENCODER_NEXT_KIND = "wan-vae-encoder-next-frames"
WAN_COMPONENTS = {
    "text_encoder": TEXT_ENCODER_KIND,
    "transformer": "wan",
    "transformer_2": "wan",
    "vae_decoder/first_frame": VAE_FIRST_FRAME_KIND,
    "vae_decoder/next_frame": VAE_NEXT_FRAME_KIND,
    "vae_encoder": VAE_ENCODER_KIND,
    "vae_encoder_next": VAE_ENCODER_NEXT_KIND,
}
OPTIONAL_COMPONENTS = ("transformer_2", "vae_encoder", "vae_encoder_next")
# Files are hashed in pieces of this size, so a 30 GB IR never sits in memory twice.
_HASH_CHUNK = 16 << 20


class ModelDirError(NumaovError):
    """A model directory (or its manifest) that is missing, incomplete, corrupt, or not what
    the command expects."""


@dataclass(frozen=True)
class TensorSpec:
    """One graph input or output; ``shape`` holds ints (static) or axis names (dynamic)."""

    name: str
    dtype: str
    shape: list[int | str]


@dataclass(frozen=True)
class RankFiles:
    """The files of one rank, relative to the model directory."""

    rank: int
    # None: a graph only OpenVINO runs (a Wan transformer's sequence-parallel split, whose
    # collectives no ONNX runtime has), kept as IR only
    onnx: str | None
    ir_xml: str
    ir_bin: str
    # The rank's expert store (``custom_ops.expert_store``), None for a graph without routed
    # experts or one holding them as constants (exports from before the store).
    experts: str | None = None


@dataclass(frozen=True)
class FileDigest:
    """What a file held when the export wrote it."""

    size: int
    xxh3_128: str


def digest_file(path: str | Path) -> FileDigest:
    """Size and xxh3-128 of ``path`` (xxh3 reads at about memory speed)."""
    import xxhash

    hasher = xxhash.xxh3_128()
    size = 0
    with Path(path).open("rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            hasher.update(chunk)
            size += len(chunk)
    return FileDigest(size=size, xxh3_128=hasher.hexdigest())


def digest_files(model_dir: str | Path, names: Iterable[str]) -> dict[str, FileDigest]:
    """The ``files`` field for ``names`` (paths relative to ``model_dir``)."""
    return {name: digest_file(Path(model_dir) / name) for name in sorted(set(names))}


# The phases of a language-model step whose rows the per-row criterion also judges apart: the
# shares pool every input set, where the few rows of one phase (a bug in reading the cache)
# could all be wrong. A phase must keep PHASE_MIN_ROW_SHARE of its own rows within: such a
# bug leaves none; correct exports kept 67% at worst (fp8 decode of a seeded Qwen3-MoE,
# ``benchmarks/parity_shares.py``).
PREFILL, CACHED = "prefill", "decode with a cache"
PHASE_MIN_ROW_SHARE = 0.5


def row_phase(shapes: Mapping[str, Sequence[int]]) -> str:
    """The phase of an input set, from its shapes: ``CACHED`` when its sequences have cached
    tokens (``past_slots [batch, past]``), else ``PREFILL``."""
    past = shapes.get("past_slots", ())
    return CACHED if len(past) > 1 and past[1] > 0 else PREFILL


@dataclass(frozen=True)
class RowShare:
    """The per-row parity criterion's verdict (an export that rounds, ``exporter.parity``) on
    one output of one backend over every input set; ``phases``: (phase, rows, rows within) per
    ``row_phase``."""

    backend: str
    output: str
    rows: int
    rows_within: int
    token_rows: int
    rows_same_argmax: int
    tolerance: float
    min_row_share: float
    min_token_share: float
    phases: tuple[tuple[str, int, int], ...] = ()

    @property
    def short_phases(self) -> list[tuple[str, int, int]]:
        """The phases that keep fewer than PHASE_MIN_ROW_SHARE of their rows within."""
        return [p for p in self.phases if p[2] < PHASE_MIN_ROW_SHARE * p[1]]

    @property
    def passed(self) -> bool:
        return (self.rows_within >= self.min_row_share * self.rows
                and self.rows_same_argmax >= self.min_token_share * self.token_rows
                and not self.short_phases)

    def describe(self) -> str:
        tokens = (f", {self.rows_same_argmax} of {self.token_rows} keep PyTorch's argmax "
                  f"(required: {self.min_token_share:.0%})" if self.token_rows else "")
        phases = "".join(f", {within} of {rows} in {phase} (required: "
                         f"{PHASE_MIN_ROW_SHARE:.0%})" for phase, rows, within in self.short_phases)
        return (f"{self.backend} output {self.output!r}: {self.rows_within} of {self.rows} rows "
                f"within {self.tolerance:g} of the output's scale (required: "
                f"{self.min_row_share:.0%}){tokens}{phases}")


def row_shares(figures: Iterable[Mapping[str, Any]]) -> list[RowShare]:
    """Parity figures as the manifest records them (``ParityFigure.as_dict()``), those of the
    per-row criterion pooled per (backend, output) over the input sets (one decode step has a
    few rows, so the share is taken over all of them), and per phase within that."""
    pooled: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for figure in figures:
        if figure.get("min_row_share") is not None:
            pooled.setdefault((figure["backend"], figure["output"]), []).append(figure)
    shares = []
    for (backend, output), group in pooled.items():
        tokens = [f for f in group if f.get("rows_same_argmax") is not None]
        phases: dict[str, list[int]] = {}  # phase -> [rows, rows within]
        for f in group:
            counts = phases.setdefault(row_phase(f.get("shapes", {})), [0, 0])
            counts[0] += f.get("rows") or 0
            counts[1] += f.get("rows_within") or 0
        shares.append(RowShare(
            backend, output, sum(rows for rows, _ in phases.values()),
            sum(within for _, within in phases.values()),
            sum(f.get("rows") or 0 for f in tokens),
            sum(f.get("rows_same_argmax") or 0 for f in tokens), float(group[0]["tolerance"]),
            float(group[0]["min_row_share"] or 0.0),
            float(group[0].get("min_token_share") or 0.0),
            tuple((phase, rows, within) for phase, (rows, within) in phases.items() if rows)))
    return shares


@dataclass(frozen=True)
class CacheLayout:
    """One layer's KV-cache entry of one token: named ``parts`` (name, values) laid side by
    side, ``width`` values in all, for ``layers`` layers, each value a ``dtype``
    (``CACHE_DTYPES``). ``kind`` names the attention design (``"mla"``, ``"gqa"``)."""

    kind: str
    layers: int
    parts: tuple[tuple[str, int], ...]
    dtype: str = "f32"

    @property
    def width(self) -> int:
        return sum(size for _, size in self.parts)

    def pool_bytes(self, tokens: int) -> int:
        """The bytes of a pool of ``tokens`` slots."""
        return self.layers * self.width * tokens * CACHE_DTYPES[self.dtype]

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "layers": self.layers, "width": self.width,
                "parts": [[name, size] for name, size in self.parts], "dtype": self.dtype}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], where: str) -> CacheLayout:
        try:
            layout = cls(str(values["kind"]), int(values["layers"]),
                         tuple((str(n), int(s)) for n, s in values["parts"]),
                         str(values.get("dtype", "f32")))
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelDirError(f"{where}: cache_layout {dict(values)!r} is malformed ({exc}); "
                              "expected kind, layers and parts: re-export the model") from None
        if layout.layers < 1 or not layout.parts or any(s < 1 for _, s in layout.parts) \
                or layout.dtype not in CACHE_DTYPES \
                or int(values.get("width", layout.width)) != layout.width:
            raise ModelDirError(f"{where}: cache_layout {dict(values)!r} is inconsistent; "
                              "re-export the model")
        return layout


@dataclass
class ExportManifest:
    """Everything the runtime needs to know about an exported model directory."""

    kind: str
    config: dict[str, Any]
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    precision: str
    inference_precision: str
    lowering: str
    ranks: list[RankFiles]
    versions: dict[str, str]
    files: dict[str, FileDigest] = field(default_factory=dict)
    parity: list[dict[str, Any]] = field(default_factory=list)
    parity_attention: str | None = None
    source_checkpoint: str | None = None
    export_seconds: dict[str, float] = field(default_factory=dict)
    reference_sample: str | None = None
    collective_group: str | None = None
    timestep: str | None = None
    notes: list[str] = field(default_factory=list)
    components: list[str] = field(default_factory=list)
    world_size: int = 1
    weights: str | None = None
    weights_group_size: int | None = None
    family: str | None = None
    cache_layout: dict[str, Any] | None = None
    kept_aside: dict[str, str] = field(default_factory=dict)
    loras: list[dict[str, Any]] = field(default_factory=list)
    # What a Wan graph was exported from (``exporter.reuse``): ``--reuse`` takes it when equal.
    source_digest: str | None = None
    format_version: int = FORMAT_VERSION

    @property
    def cache(self) -> CacheLayout:
        """A language model's per-layer KV-cache entry (``cache_layout``)."""
        if self.cache_layout is None:
            raise ModelDirError(f"the {self.kind!r} export has no cache layout; expected a "
                                f"{LM_KIND!r} export")
        return CacheLayout.from_dict(self.cache_layout, MANIFEST_NAME)

    def summary(self, model_dir: str | Path) -> str:
        """One line for the CLI: what was written and the worst parity figure per backend."""
        worst: dict[str, float] = {}
        for figure in self.parity:
            if not figure.get("judged", True):
                continue  # kept for the record (a bf16 Wan transformer is judged per block)
            key = f"{figure['backend']} {figure['precision']}"
            if figure.get("criterion") == "rms":
                key += " per block (RMS)"
            worst[key] = max(worst.get(key, 0.0), float(figure["rel_error"]))
        parity = ", ".join(f"{k} {v:.2g}" for k, v in worst.items()) or "not checked"
        # Only the non-default timestep is named, so scalar exports read as they always did.
        timestep = ", per-frame timestep" if self.timestep == "per-frame" else ""
        attention = (f" ({self.parity_attention} attention)"
                     if self.parity_attention == "numaov" else "")
        weights = (f", {self.weights} weights"
                   if self.weights is not None and self.weights != self.precision else "")
        loras = f", {len(self.loras)} LoRA(s) merged" if self.loras else ""
        return (
            f"exported {self.kind} ({self.precision}{weights}, {self.lowering} ops{timestep}"
            f"{loras}) to "
            f"{model_dir}; parity vs torch (max rel error): {parity}{attention}"
            f"{self._row_parity()}"
        )

    def _row_parity(self) -> str:
        """The per-row parity of an export that rounds (``exporter.parity``), for the CLI line:
        per output, its rows within tolerance and greedy tokens kept over every input set."""
        shares = row_shares(self.parity)
        if not shares:
            return ""
        parts = [f"{s.output} {s.rows_within} of {s.rows} rows within"
                 + (f", {s.rows_same_argmax} of {s.token_rows} greedy tokens equal"
                    if s.token_rows else "") for s in shares]
        first = shares[0]
        return (f"; checked per row (tolerance {first.tolerance:g}, required "
                f"{first.min_row_share:.0%} of rows, {first.min_token_share:.0%} of "
                f"tokens): {'; '.join(parts)}")

    def write_and_report(
        self, model_dir: str | Path, timings: dict[str, float], report: Callable[[str], None]
    ) -> None:
        """Write the manifest (the last file of an export) and report the stage timings."""
        self.write(model_dir)
        report(
            f"exported in {sum(timings.values()):.1f} s ("
            + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items())
            + ")"
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=False) + "\n"

    def write(self, model_dir: str | Path) -> Path:
        """Write ``model_dir/manifest.json`` (atomically, so a crash never leaves half a file)."""
        path = Path(model_dir) / MANIFEST_NAME
        tmp = path.with_suffix(".json.tmp")
        try:
            tmp.write_text(self.to_json(), encoding="utf-8")
            tmp.replace(path)
        except OSError as exc:
            raise ModelDirError(f"cannot write {str(path)!r} ({exc})") from exc
        logger.info("wrote %s", path)
        return path

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "manifest") -> ExportManifest:
        """Rebuild and check a manifest from its JSON object (the inverse of ``to_json``)."""
        version = _field(data, "format_version", int, where)
        if version != FORMAT_VERSION:
            raise ModelDirError(
                f"{where} has format_version {version}; this numaov reads version "
                f"{FORMAT_VERSION}: re-export the model with this numaov"
            )
        try:
            fields = dict(data)
            fields["inputs"] = [TensorSpec(**t) for t in _field(data, "inputs", list, where)]
            fields["outputs"] = [TensorSpec(**t) for t in _field(data, "outputs", list, where)]
            fields["ranks"] = [RankFiles(**r) for r in _field(data, "ranks", list, where)]
            fields["files"] = {
                str(k): FileDigest(**v) for k, v in _field(data, "files", dict, where).items()
            }
            manifest = cls(**fields)
        except TypeError as exc:
            raise ModelDirError(
                f"{where} has a missing, unknown or malformed field ({exc}); expected the "
                "fields written by numaov's exporter: re-export the model"
            ) from exc
        manifest._check(where)
        return manifest

    def _check(self, where: str) -> None:
        """The cross-field rules every reader relies on."""
        # the fields as they are (asdict would deep-copy the whole manifest, its parity
        # figures and file digests, once per key: 0.15 s of every read of a Wan pipeline)
        fields = vars(self)
        for key, kind in (("kind", str), ("config", dict), ("precision", str),
                          ("inference_precision", str), ("lowering", str),
                          ("versions", dict), ("world_size", int)):
            _field(fields, key, kind, where)
        if self.lowering not in LOWERINGS:
            raise ModelDirError(f"{where}: lowering {self.lowering!r} is not one of {LOWERINGS}")
        for key in ("precision", "inference_precision"):
            if getattr(self, key) not in PRECISIONS:
                raise ModelDirError(
                    f"{where}: {key} {getattr(self, key)!r} is not one of {PRECISIONS}"
                )
        if self.weights is not None and self.weights not in WEIGHT_FORMATS:
            raise ModelDirError(
                f"{where}: weights {self.weights!r} is not one of {WEIGHT_FORMATS}"
            )
        if not isinstance(self.components, list) or not all(
            isinstance(c, str) and c and not c.startswith(("/", ".")) for c in self.components
        ):
            raise ModelDirError(f"{where}: components {self.components!r} are not subdirectories")
        if (self.kind == PIPELINE_KIND) != bool(self.components):
            raise ModelDirError(
                f"{where}: kind {self.kind!r} with components {self.components}; expected "
                f"components exactly for kind {PIPELINE_KIND!r}: re-export the model"
            )
        if self.components and self.ranks:
            raise ModelDirError(f"{where}: a pipeline manifest lists ranks; expected none")
        # A pipeline's graphs are in its components' own manifests.
        if not self.components and sorted(r.rank for r in self.ranks) != list(
            range(self.world_size)
        ):
            raise ModelDirError(
                f"{where}: ranks {[r.rank for r in self.ranks]} do not cover world_size "
                f"{self.world_size}"
            )
        if self.world_size > 1 and not (isinstance(self.collective_group, str)
                                         and self.collective_group):
            raise ModelDirError(
                f"{where} is exported for {self.world_size} ranks but names no "
                "collective_group; re-export the model with numaov"
            )
        if (self.kind == LM_KIND) != (self.family is not None):
            raise ModelDirError(
                f"{where}: kind {self.kind!r} with family {self.family!r}; expected a family "
                f"exactly for kind {LM_KIND!r}: re-export the model"
            )
        if self.kind == LM_KIND:
            if not (isinstance(self.family, str) and self.family
                    and isinstance(self.cache_layout, dict)):
                raise ModelDirError(
                    f"{where}: family {self.family!r} and cache_layout {self.cache_layout!r}; "
                    "expected a family name and its cache layout: re-export the model"
                )
            CacheLayout.from_dict(self.cache_layout, where)
        if self.kind == "wan":
            rank = {"scalar": 1, "per-frame": 2}.get(self.timestep or "")
            if rank is None:
                raise ModelDirError(
                    f"{where}: timestep {self.timestep!r} is not one of {TIMESTEP_KINDS}"
                )
            shape = {spec.name: spec.shape for spec in self.inputs}.get("timestep")
            if shape is not None and len(shape) != rank:
                raise ModelDirError(
                    f"{where}: timestep is {self.timestep!r} but the graph's timestep input "
                    f"has shape {shape}; expected {rank} axes: re-export the model"
                )
        if self.parity_attention is not None and self.parity_attention not in ATTENTION_KERNELS:
            raise ModelDirError(
                f"{where}: parity_attention {self.parity_attention!r} is not one of "
                f"{ATTENTION_KERNELS}"
            )

    @classmethod
    def read(cls, model_dir: str | Path, expected_kind: str | None = None) -> ExportManifest:
        """Read and check ``model_dir/manifest.json``, and that every file it lists is there
        with the size the export wrote (digests are checked later, by `verify_file`, when a
        file is about to be used). ``expected_kind`` is e.g. ``"wan"``."""
        directory = Path(model_dir)
        if not directory.exists():
            raise ModelDirError(
                f"model directory {str(directory)!r} does not exist; expected the output "
                "directory of `numaov export`"
            )
        if not directory.is_dir():
            raise ModelDirError(
                f"model directory {str(directory)!r} is a file; expected a directory"
            )
        path = directory / MANIFEST_NAME
        if not path.is_file():
            raise ModelDirError(
                f"{str(directory)!r} has no {MANIFEST_NAME}; expected a directory written by "
                "`numaov export`"
            )
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ModelDirError(f"cannot read {str(path)!r} as JSON ({exc})") from exc
        if not isinstance(data, dict):
            raise ModelDirError(
                f"{str(path)!r} holds a JSON {type(data).__name__}; expected an object"
            )
        manifest = cls.from_dict(data, repr(str(path)))
        if expected_kind is not None and manifest.kind != expected_kind:
            raise ModelDirError(
                f"{str(directory)!r} holds a {manifest.kind!r} model; expected a "
                f"{expected_kind!r} model"
            )
        named = [(r.rank, key, getattr(r, key)) for r in manifest.ranks
                 for key in ("onnx", "ir_xml", "ir_bin") if getattr(r, key) is not None]
        if manifest.reference_sample is not None:
            named.append((None, "reference sample", manifest.reference_sample))
        named += [(None, "component manifest", f"{c}/{MANIFEST_NAME}") for c in manifest.components]
        for rank, what, name in named:
            if not (directory / name).is_file():
                label = what if rank is None else f"rank {rank} {what}"
                raise ModelDirError(
                    f"{str(directory)!r} is incomplete: {name!r} ({label}) is missing; "
                    "re-export the model"
                )
        for name, digest in manifest.files.items():
            manifest._check_size(directory, name, digest)
        return manifest

    def _check_size(self, directory: Path, name: str, digest: FileDigest) -> None:
        file = directory / name
        size = file.stat().st_size if file.is_file() else None
        if size != digest.size:
            found = "missing" if size is None else f"{size:,} bytes"
            raise ModelDirError(
                f"{str(file)!r} is {found}; the export wrote {digest.size:,} bytes (truncated "
                "or replaced since): re-export the model or restore the file"
            )

    def verify_file(self, model_dir: str | Path, name: str) -> Path:
        """``model_dir/name`` after checking its size and digest against the export's;
        returns its path. A file the manifest does not list is returned unchecked."""
        directory = Path(model_dir)
        digest = self.files.get(name)
        if digest is not None:
            self._check_size(directory, name, digest)
            if digest_file(directory / name).xxh3_128 != digest.xxh3_128:
                raise ModelDirError(
                    f"{str(directory / name)!r} does not hold what the export wrote (its "
                    "xxh3-128 digest differs: corrupt or replaced): re-export the model or "
                    "restore the file"
                )
        return directory / name


def _field(data: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in data:
        raise ModelDirError(f"{where} has no {key!r} field; re-export the model with numaov")
    value = data[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ModelDirError(f"{where}: field {key!r} is malformed ({value!r})")
    return value
