"""Multi-head latent attention (MLA, DeepSeek-V2 / V3 / Kimi-K2); the mask it is given is
:func:`numaov.models.layers.attention_mask.causal_attention_mask`.

The families read their own config keys and hand :class:`MultiHeadLatentAttention` plain
numbers: the head dims, the LoRA ranks, the softmax scale and which rope layout the
checkpoint's rope dims use.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from numaov.custom_ops import rotary_embedding
from numaov.models.layers.config_keys import Fail
from numaov.models.layers.norm import RMSNorm

# The latent norms inside MLA use the RMSNorm default, not config.rms_norm_eps (as in
# DeepSeek's code and transformers).
LATENT_NORM_EPS = 1e-6


class MlaConfig:
    """What an MLA family's config (DeepSeek-V2, V3) derives from its Hugging Face keys and
    checks of them; mixed into the family's config dataclass."""

    num_attention_heads: int
    num_key_value_heads: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    rope_scaling: dict[str, Any] | None

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Per-token, per-layer cache width: the normalised latent and the rotated rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def check_mla(self, fail: Fail) -> None:
        """Rope rotates pairs; every head reads the one latent; yarn (when set) has its
        sizes."""
        if self.qk_rope_head_dim % 2:
            fail(f"qk_rope_head_dim is {self.qk_rope_head_dim}; expected an even number "
                 "(rope rotates pairs)")
        if self.num_key_value_heads not in (None, self.num_attention_heads):
            fail(f"num_key_value_heads is {self.num_key_value_heads} but num_attention_heads is "
                 f"{self.num_attention_heads}; MLA expands its latent to every head, expected "
                 "them equal")
        if self.rope_scaling is not None:
            for key in ("factor", "original_max_position_embeddings"):
                value = self.rope_scaling.get(key)
                if not isinstance(value, (int, float)) or value <= 0:
                    fail(f"yarn rope_scaling needs a positive {key!r}; got {value!r}")


class MultiHeadLatentAttention(nn.Module):
    """MLA: queries from a (low-rank) projection, keys and values from a shared latent.

    The cache holds, per token, the normalised latent ``[kv_lora_rank]`` and the rotated rope
    key ``[rope_dim]`` (the same compressed cache as transformers); attention runs on it
    directly, with ``kv_b_proj`` absorbed into the query and the output (step 3).

    ``q_lora_rank`` None: one ``q_proj``; else ``q_a_proj`` -> ``q_a_layernorm`` ->
    ``q_b_proj``. ``interleaved_rope``: the rope dims rotate adjacent pairs (DeepSeek's layout)
    rather than the two halves.
    """

    #: The projections run as linear layers, which an export may run on numaov's DenseLinear
    #: op (``exporter.dense_projections``); ``kv_b_proj`` is read as two batched weights
    #: (step 3), not run as a layer.
    PROJECTIONS = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj")

    def __init__(self, hidden: int, heads: int, *, q_lora_rank: int | None, kv_lora_rank: int,
                 nope_dim: int, rope_dim: int, v_dim: int, attention_bias: bool,
                 softmax_scale: float, interleaved_rope: bool = True) -> None:
        super().__init__()
        self.num_heads = heads
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.nope_dim = nope_dim
        self.rope_dim = rope_dim
        self.v_dim = v_dim
        self.qk_dim = nope_dim + rope_dim
        self.interleaved_rope = interleaved_rope
        if q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, heads * self.qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, q_lora_rank, bias=attention_bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(q_lora_rank, heads * self.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, kv_lora_rank + rope_dim, bias=attention_bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(kv_lora_rank, heads * (nope_dim + v_dim), bias=False)
        self.o_proj = nn.Linear(heads * v_dim, hidden, bias=attention_bias)
        self.softmax_scale = softmax_scale

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, past: Tensor
    ) -> tuple[Tensor, Tensor]:
        """``x [B, T, H]``, ``cos/sin [B*T, Dr/2]``, ``mask [B, 1, T, P+T]`` (bool, True =
        attend), ``past [B, P, R+Dr]`` -> ``(out [B, T, H], new [B, T, R+Dr])``: ``new`` is
        this step's cache entries, the ones that follow ``past``."""
        b, t, _ = x.shape
        heads = self.num_heads
        # 1. queries: [B, T, heads, qk] split into the no-rope and rope parts
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(b, t, heads, self.qk_dim)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        # rows of cos/sin are (batch, token) pairs: rope sees x as [B*T, heads, Dr]
        q_pe = rotary_embedding(q_pe.reshape(b * t, heads, self.rope_dim), cos, sin,
                                self.interleaved_rope)

        # 2. this step's cache entries, appended to the past
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], -1)
        latent = self.kv_a_layernorm(latent)
        k_pe = rotary_embedding(k_pe.reshape(b * t, 1, self.rope_dim), cos, sin,
                                self.interleaved_rope)
        present = torch.cat((past, torch.cat((latent, k_pe.view(b, t, self.rope_dim)), -1)), 1)
        # cut from the concatenation, as in layers.gqa (an f32 pool's conversion to bf16)
        new = present[:, past.shape[1]:]

        # 3. attention in the latent space ("absorbed" MLA): kv_b_proj's key half is folded
        #    into the query and its value half applied after the attention, so the cached
        #    latents are read as they are and never expanded per head: a step costs
        #    O(cached tokens x (kv_lora_rank + rope dim)) per head instead of a kv_b_proj
        #    matmul over every cached token. The same sums as keys/values expanded first, in
        #    another order.
        #    Every head reads the same entries, so the heads' queries are the rows of one
        #    matrix [heads*T, R+Dr] against them: one matmul reads each cached entry once,
        #    where a per-head batch dim broadcast against one entry matrix had OpenVINO read
        #    the entries once per head.
        #    The absorbed weights multiply each head's rows of every sequence at once
        #    ([heads, B*T, .] against [heads, ., .]): a batch dim of B broadcast against them
        #    had OpenVINO run B*heads one-row products (a V3-shaped layer's two took 0.35
        #    against 0.13 ms each at 8 sequences).
        w_uk, w_uv = self._absorbed_weights()  # [heads, nope, R], [heads, v, R]
        r = self.kv_lora_rank
        q_lat = torch.matmul(q_nope.permute(2, 0, 1, 3).reshape(heads, b * t, self.nope_dim), w_uk)
        q_lat = q_lat.view(heads, b, t, r).transpose(0, 1)  # [B, heads, T, R]
        q_all = torch.cat((q_lat, q_pe.view(b, t, heads, self.rope_dim).transpose(1, 2)), -1)
        s = present.shape[1]
        # the scale on the query (T rows) rather than on the scores (T x S): at 4,096 cached
        # tokens the scores' multiply was 0.1-0.2 ms of a V3-shaped layer's step
        width = r + self.rope_dim  # named, not -1: an idle rank has B = 0
        rows = (q_all * self.softmax_scale).reshape(b, heads * t, width)  # [B, heads*T, R+Dr]
        scores = torch.matmul(rows, present.transpose(1, 2)).view(b, heads, t, s)
        scores = scores.masked_fill(~mask, float("-inf"))  # [B, heads, T, S]
        probs = torch.softmax(scores.float(), dim=-1).to(present.dtype)
        # the values are the entries' latents: multiplied by the whole entries and the rope
        # columns of the (small) result dropped, since slicing the latents out of the past
        # first copied it (0.25 ms a layer at 4,096 tokens) to save 11% of this matmul
        context = torch.matmul(probs.view(b, heads * t, s), present)[..., :r]
        context = context.reshape(b, heads, t, r).transpose(0, 1).reshape(heads, b * t, r)
        out = torch.matmul(context, w_uv.transpose(1, 2))  # [heads, B*T, v]

        # 4. output projection
        out = out.view(heads, b, t, self.v_dim).permute(1, 2, 0, 3).reshape(b, t, heads * self.v_dim)
        return self.o_proj(out), new

    def _absorbed_weights(self) -> tuple[Tensor, Tensor]:
        """kv_b_proj's weight ``[heads*(nope+v), R]`` split per head into its key part
        ``[heads, nope, R]`` and value part ``[heads, v, R]``."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim,
                                       self.kv_lora_rank)
        return w[:, :self.nope_dim], w[:, self.nope_dim:]

