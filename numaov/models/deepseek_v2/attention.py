"""Multi-head latent attention (MLA) and the attention mask it is given."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from numaov.custom_ops import rotary_embedding
from numaov.models.deepseek_v2.config import DeepseekV2Config
from numaov.models.layers.norm import RMSNorm
from numaov.models.layers.rope import yarn_softmax_factor

# The latent norms inside MLA use the RMSNorm default, not config.rms_norm_eps (as in
# DeepSeek's code and transformers).
LATENT_NORM_EPS = 1e-6


class DeepseekV2Attention(nn.Module):
    """MLA: queries from a (low-rank) projection, keys and values from a shared latent.

    The cache holds, per token, the normalised latent ``[kv_lora_rank]`` and the rotated rope
    key ``[qk_rope_head_dim]`` (the same compressed cache as transformers); attention runs on
    it directly, with ``kv_b_proj`` absorbed into the query and the output (step 3).
    """

    def __init__(self, config: DeepseekV2Config) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank = config.kv_lora_rank
        self.nope_dim = config.qk_nope_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.v_dim = config.v_head_dim
        self.qk_dim = config.qk_head_dim
        hidden, heads = config.hidden_size, config.num_attention_heads
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, heads * self.qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, config.q_lora_rank, bias=config.attention_bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(config.q_lora_rank, heads * self.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(
            hidden, config.kv_lora_rank + self.rope_dim, bias=config.attention_bias
        )
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(
            config.kv_lora_rank, heads * (self.nope_dim + self.v_dim), bias=False
        )
        self.o_proj = nn.Linear(heads * self.v_dim, hidden, bias=config.attention_bias)
        # 1/sqrt(qk_head_dim), sharpened under yarn by the factor the rope tables are scaled by
        self.softmax_scale = config.qk_head_dim ** -0.5 * yarn_softmax_factor(config.rope_scaling)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, past: Tensor
    ) -> tuple[Tensor, Tensor]:
        """``x [B, T, H]``, ``cos/sin [B*T, Dr/2]``, ``mask [B, 1, T, P+T]`` (bool, True =
        attend), ``past [B, P, R+Dr]`` -> ``(out [B, T, H], present [B, P+T, R+Dr])``."""
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
        q_pe = rotary_embedding(q_pe.reshape(b * t, heads, self.rope_dim), cos, sin, True)

        # 2. this step's cache entries, appended to the past
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], -1)
        latent = self.kv_a_layernorm(latent)
        k_pe = rotary_embedding(k_pe.reshape(b * t, 1, self.rope_dim), cos, sin, True)
        present = torch.cat((past, torch.cat((latent, k_pe.view(b, t, self.rope_dim)), -1)), 1)

        # 3. attention in the latent space ("absorbed" MLA): kv_b_proj's key half is folded
        #    into the query and its value half applied after the attention, so the cached
        #    latents are read as they are and never expanded per head: a step costs
        #    O(cached tokens x (kv_lora_rank + rope dim)) per head instead of a kv_b_proj
        #    matmul over every cached token. The same sums as keys/values expanded first, in
        #    another order.
        w_uk, w_uv = self._absorbed_weights()  # [heads, nope, R], [heads, v, R]
        latent_all, k_pe_all = present.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        q_lat = torch.matmul(q_nope.transpose(1, 2), w_uk)  # [B, heads, T, R]
        q_all = torch.cat((q_lat, q_pe.view(b, t, heads, self.rope_dim).transpose(1, 2)), -1)
        keys = torch.cat((latent_all, k_pe_all), dim=-1).unsqueeze(1)  # [B, 1, S, R+Dr]
        scores = torch.matmul(q_all, keys.transpose(-1, -2)) * self.softmax_scale
        scores = scores.masked_fill(~mask, float("-inf"))  # [B, heads, T, S]
        probs = torch.softmax(scores.float(), dim=-1).to(latent_all.dtype)
        context = torch.matmul(probs, latent_all.unsqueeze(1))  # [B, heads, T, R]
        out = torch.matmul(context, w_uv.transpose(1, 2))  # [B, heads, T, v]

        # 4. output projection
        out = out.transpose(1, 2).reshape(b, t, heads * self.v_dim)
        return self.o_proj(out), present

    def _absorbed_weights(self) -> tuple[Tensor, Tensor]:
        """kv_b_proj's weight ``[heads*(nope+v), R]`` split per head into its key part
        ``[heads, nope, R]`` and value part ``[heads, v, R]``."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim,
                                       self.kv_lora_rank)
        return w[:, :self.nope_dim], w[:, self.nope_dim:]


def _attention_mask(attention_mask: Tensor, t: int) -> Tensor:
    """``attention_mask [B, S]`` (1 = real token, past and current) -> bool ``[B, 1, T, S]``.

    Query ``i`` (cache slot ``S-T+i``) sees the real tokens at slots ``<= S-T+i``, and always
    itself, so a padding query has one finite score instead of a NaN row that would leak into
    the cache of the real tokens through ``0 * NaN``.
    """
    s = attention_mask.shape[1]
    query_slot = torch.arange(t, device=attention_mask.device).unsqueeze(1) + (s - t)  # [T, 1]
    key_slot = torch.arange(s, device=attention_mask.device).unsqueeze(0)  # [1, S]
    causal = key_slot <= query_slot
    real = attention_mask.bool()[:, None, None, :]  # [B, 1, 1, S]
    return (causal & real) | (key_slot == query_slot)
