"""Grouped-query attention (GQA) over a cache of per-token K and V heads; the mask it is given
is :func:`numaov.models.layers.attention_mask.causal_attention_mask`.

The cache entry of one token and layer is its keys then its values, each ``kv_heads *
head_dim`` wide and head-major (``CacheLayout("gqa", layers, (("key", kv_heads*head_dim),
("value", kv_heads*head_dim)))``): the keys are stored rotated, so a cached entry is read as
it is. Queries are grouped by the KV head they share (``heads // kv_heads`` per KV head) and
attend as the rows of one matrix per KV head, so K and V are never repeated per query head.

Keys and values are read from the past and this step's entries by one transpose of both
halves at once; the attention returns only this step's entries. Splitting the entries into
keys and values first and transposing each (a VariadicSplit, which OpenVINO's CPU plugin runs
with its reference kernel, and layout Reorders) made a Qwen3-30B-A3B-shaped layer step at
4,096 cached tokens 1.6x as long (RESULTS.md, "Long-context GQA step").

The math is plain (matmul, mask, fp32 softmax, matmul), which ``torch.export`` and the ONNX
exporter take as it is and OpenVINO runs; rope is numaov's ``rotary_embedding`` op in the
half-split (NeoX) layout the Llama / Qwen families use.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from numaov.custom_ops import rotary_embedding
from numaov.models.layers.norm import RMSNorm


class GroupedQueryAttention(nn.Module):
    """Multi-head attention with ``kv_heads`` key/value heads shared by ``heads`` query heads.

    Parameter names are transformers' (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, and
    ``q_norm`` / ``k_norm`` for the per-head RMSNorm of Qwen3 / OLMo-2 style models, applied
    before rope when ``qk_norm_eps`` is given). ``qkv_bias`` adds biases to the q/k/v
    projections, ``o_bias`` to the output projection.
    """

    #: The linear layers an export may run on numaov's DenseLinear op
    #: (``exporter.dense_projections``).
    PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, *,
                 qkv_bias: bool = False, o_bias: bool = False,
                 qk_norm_eps: float | None = None) -> None:
        super().__init__()
        assert heads % kv_heads == 0, "query heads must be a multiple of the KV heads"
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=o_bias)
        if qk_norm_eps is not None:
            self.q_norm: RMSNorm | None = RMSNorm(head_dim, qk_norm_eps)
            self.k_norm: RMSNorm | None = RMSNorm(head_dim, qk_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.scale = head_dim ** -0.5

    @property
    def entry_width(self) -> int:
        """One token's cache entry: its K heads then its V heads."""
        return 2 * self.kv_heads * self.head_dim

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, past: Tensor
    ) -> tuple[Tensor, Tensor]:
        """``x [B, T, H]``, ``cos/sin [B*T, D/2]``, ``mask [B, 1, T, P+T]`` (bool, True =
        attend), ``past [B, P, 2*kv*D]`` -> ``(out [B, T, H], new [B, T, 2*kv*D])``: ``new``
        is this step's cache entries, the ones that follow ``past``."""
        b, t, _ = x.shape
        p = past.shape[1]
        heads, kv, d = self.heads, self.kv_heads, self.head_dim
        g = heads // kv
        # 1. projections, per-head norm (when the model has one), rope on q and k;
        #    rows of cos/sin are (batch, token) pairs: rope sees [B*T, heads, D]
        q = self.q_proj(x).view(b, t, heads, d)
        k = self.k_proj(x).view(b, t, kv, d)
        v = self.v_proj(x)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = rotary_embedding(q.reshape(b * t, heads, d), cos, sin, False)
        k = rotary_embedding(k.reshape(b * t, kv, d), cos, sin, False)

        # 2. this step's cache entries (rotated keys, values) after the past; every token's
        #    keys and values head-major by one transpose of both halves at once. ``new`` is
        #    cut from the concatenation on purpose: an f32 pool read at bf16 precision (every
        #    export's pool before bf16 exports got bf16 pools) then stays f32 up to this
        #    Concat, where returned apart the CPU plugin moved the conversion to bf16 in
        #    front of the gather, onto the whole pool input (every slot, each step).
        present = torch.cat((past, torch.cat((k.reshape(b, t, kv * d), v), dim=-1)), dim=1)
        s = present.shape[1]
        new = present[:, p:]  # [B, T, 2*kv*D]
        keys, values = present.view(b, s, 2, kv, d).permute(2, 0, 3, 1, 4)  # [B, kv, S, D] each

        # 3. attention, the query heads of one KV head as the rows of one matrix
        #    [B, kv, g*T, D]: both sides of each matmul have the same batch dims
        q = q.view(b, t, kv, g, d).permute(0, 2, 3, 1, 4).reshape(b, kv, g * t, d)
        # the scale on the query rather than the scores, as in layers.mla
        scores = torch.matmul(q * self.scale, keys.transpose(-1, -2))  # [B, kv, g*T, S]
        scores = scores.view(b, kv, g, t, s).masked_fill(~mask.unsqueeze(1), float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(values.dtype).view(b, kv, g * t, s)
        context = torch.matmul(probs, values)  # [B, kv, g*T, D]

        # 4. output projection (heads in kv-major order: head h = group * (heads/kv) + i)
        out = context.view(b, kv, g, t, d).permute(0, 3, 1, 2, 4).reshape(b, t, heads * d)
        return self.o_proj(out), new
