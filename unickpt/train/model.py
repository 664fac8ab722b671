"""A small Llama-style decoder in plain torch, tensor-parallel aware.

Parameter names and shapes match Hugging Face ``LlamaForCausalLM`` (the full shapes; each TP
rank holds blocks of them), RMSNorm, rotary embeddings and the SwiGLU MLP follow the HF
implementation, so the model part of a checkpoint is a Llama checkpoint.

Megatron-style TP: q/k/v/gate/up are column-parallel (rows of the HF weight split over TP
ranks, heads stay whole), o/down are row-parallel (columns split; outputs all-reduced).
Embedding, norms and lm_head are replicated over TP.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .parallel import TPGroup, copy_to_tp, reduce_from_tp

__all__ = ["LlamaConfig", "Llama", "param_specs", "hf_config"]


@dataclass(frozen=True, kw_only=True, slots=True)
class LlamaConfig:
    vocab_size: int = 256
    """Byte-level tokens by default."""
    hidden_size: int = 64
    intermediate_size: int = 176
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    max_position_embeddings: int = 1024
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} must be divisible by num_attention_heads {self.num_attention_heads}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


def hf_config(cfg: LlamaConfig, torch_dtype: str = "float32") -> dict:
    """The ``config.json`` of the matching ``LlamaForCausalLM``."""
    d = asdict(cfg)
    d.update(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_act="silu",
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        head_dim=cfg.head_dim,
        torch_dtype=torch_dtype,
        bos_token_id=None,
        eos_token_id=None,
        initializer_range=0.02,
    )
    return d


# (name, full shape, TP split dim or None for replicated)
def param_specs(cfg: LlamaConfig) -> list[tuple[str, tuple[int, ...], int | None]]:
    h, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    kv = cfg.num_key_value_heads * cfg.head_dim
    specs: list[tuple[str, tuple[int, ...], int | None]] = [("model.embed_tokens.weight", (v, h), None)]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        specs += [
            (p + "input_layernorm.weight", (h,), None),
            (p + "self_attn.q_proj.weight", (h, h), 0),
            (p + "self_attn.k_proj.weight", (kv, h), 0),
            (p + "self_attn.v_proj.weight", (kv, h), 0),
            (p + "self_attn.o_proj.weight", (h, h), 1),
            (p + "post_attention_layernorm.weight", (h,), None),
            (p + "mlp.gate_proj.weight", (f, h), 0),
            (p + "mlp.up_proj.weight", (f, h), 0),
            (p + "mlp.down_proj.weight", (h, f), 1),
        ]
    specs += [("model.norm.weight", (h,), None), ("lm_head.weight", (v, h), None)]
    return specs


def init_full(name: str, shape: tuple[int, ...], seed: int, cfg: LlamaConfig) -> torch.Tensor:
    """Deterministic init of one full tensor, independent of the parallel layout."""
    if len(shape) == 1:
        return torch.ones(shape)
    g = torch.Generator().manual_seed(seed * 1_000_003 + sum(map(ord, name)) * 7919 + len(name))
    std = 0.02
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        std = 0.02 / math.sqrt(2 * cfg.num_hidden_layers)
    return torch.randn(shape, generator=g) * std


def tp_block(full: torch.Tensor, dim: int | None, tp: TPGroup) -> tuple[torch.Tensor, tuple[int, ...]]:
    """This TP rank's block of a full tensor and its offsets."""
    if dim is None or tp.size == 1:
        return full, (0,) * full.dim()
    n = full.shape[dim]
    if n % tp.size:
        raise ValueError(f"dimension {dim} of size {n} is not divisible by tp={tp.size}")
    k = n // tp.size
    offsets = [0] * full.dim()
    offsets[dim] = tp.rank * k
    return full.narrow(dim, tp.rank * k, k).contiguous(), tuple(offsets)


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dt)


def rope_cache(cfg: LlamaConfig, seq: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim))
    freqs = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig, tp: TPGroup) -> None:
        super().__init__()
        self.cfg, self.tp = cfg, tp
        h, hd = cfg.hidden_size, cfg.head_dim
        if cfg.num_key_value_heads % tp.size or cfg.intermediate_size % tp.size:
            raise ValueError(f"heads and intermediate_size must be divisible by tp={tp.size}")
        self.n_heads = cfg.num_attention_heads // tp.size
        self.n_kv = cfg.num_key_value_heads // tp.size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.q_proj = nn.Linear(h, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(h, self.n_kv * hd, bias=False)
        self.v_proj = nn.Linear(h, self.n_kv * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, h, bias=False)
        f = cfg.intermediate_size // tp.size
        self.gate_proj = nn.Linear(h, f, bias=False)
        self.up_proj = nn.Linear(h, f, bias=False)
        self.down_proj = nn.Linear(f, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        hd = self.cfg.head_dim
        h = copy_to_tp(self.input_layernorm(x), self.tp)
        q = self.q_proj(h).view(b, t, self.n_heads, hd).transpose(1, 2)
        k = self.k_proj(h).view(b, t, self.n_kv, hd).transpose(1, 2)
        v = self.v_proj(h).view(b, t, self.n_kv, hd).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if self.n_kv != self.n_heads:
            rep = self.n_heads // self.n_kv
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        a = a.transpose(1, 2).reshape(b, t, self.n_heads * hd)
        x = x + reduce_from_tp(self.o_proj(a), self.tp)
        h = copy_to_tp(self.post_attention_layernorm(x), self.tp)
        m = F.silu(self.gate_proj(h)) * self.up_proj(h)
        return x + reduce_from_tp(self.down_proj(m), self.tp)


class Llama(nn.Module):
    """``LlamaForCausalLM``-compatible decoder; with ``tp.size > 1`` each rank holds its blocks."""

    def __init__(self, cfg: LlamaConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = tp or TPGroup.single()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, self.tp) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self._rope: tuple[int, torch.dtype, torch.Tensor, torch.Tensor] | None = None

    def hf_params(self) -> list[tuple[str, nn.Parameter, tuple[int, ...], int | None]]:
        """``(hf_name, local parameter, full shape, tp split dim)`` in a fixed order."""
        local = {
            "model.embed_tokens.weight": self.embed_tokens.weight,
            "model.norm.weight": self.norm.weight,
            "lm_head.weight": self.lm_head.weight,
        }
        for i, blk in enumerate(self.layers):
            p = f"model.layers.{i}."
            local |= {
                p + "input_layernorm.weight": blk.input_layernorm.weight,
                p + "post_attention_layernorm.weight": blk.post_attention_layernorm.weight,
                p + "self_attn.q_proj.weight": blk.q_proj.weight,
                p + "self_attn.k_proj.weight": blk.k_proj.weight,
                p + "self_attn.v_proj.weight": blk.v_proj.weight,
                p + "self_attn.o_proj.weight": blk.o_proj.weight,
                p + "mlp.gate_proj.weight": blk.gate_proj.weight,
                p + "mlp.up_proj.weight": blk.up_proj.weight,
                p + "mlp.down_proj.weight": blk.down_proj.weight,
            }
        return [(n, local[n], shape, dim) for n, shape, dim in param_specs(self.cfg)]

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        for name, p, shape, dim in self.hf_params():
            block, _ = tp_block(init_full(name, shape, seed, self.cfg), dim, self.tp)
            p.copy_(block)

    def rope(self, t: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin tables (computed on the CPU, identical on every device), cached per device."""
        device = torch.device(device)
        r = self._rope
        if r is None or r[0] < t or r[1] != dtype or r[2].device != device:
            cos, sin = rope_cache(self.cfg, max(t, 16), dtype)
            self._rope = (max(t, 16), dtype, cos.to(device), sin.to(device))
        return self._rope[2][:t], self._rope[3][:t]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        cos, sin = self.rope(tokens.shape[1], x.dtype, x.device)
        for blk in self.layers:
            x = blk(x, cos, sin)
        return self.lm_head(self.norm(x))
