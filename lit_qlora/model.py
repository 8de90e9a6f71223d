"""One readable GPT that covers the Llama, Mistral, Qwen2, Gemma, GPT-NeoX, Falcon, Phi and StableLM families.

Every difference between the families is a field of `Config`; there are no subclasses per family.
Shapes in comments: B batch, T sequence, C n_embd, H heads, G query groups (kv heads), hs head size.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

from lit_qlora import cpu_attention, cpu_half
from lit_qlora.config import Config


class GPT(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            h=nn.ModuleList(Block(config) for _ in range(config.n_layer)),
            ln_f=make_norm(config, config.n_embd),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=config.lm_head_bias)
        if config.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight
        self.max_seq_length = config.block_size
        self.kv_caches: Optional[list[KVCache]] = None
        self.activation_checkpointing = False  # recompute each block in backward instead of keeping its activations
        self.compiled_blocks: Optional[list] = None  # set by compile_blocks(): used for training steps only

    def rope_cache(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for the given positions, computed in fp32 like the reference implementations: [T, rope_n_elem]
        for positions [T], [B, T, rope_n_elem] for per-row positions [B, T] (packed samples)."""
        c = self.config
        n = c.rope_n_elem
        inv_freq = 1.0 / (c.rope_base ** (torch.arange(0, n, 2, device=positions.device, dtype=torch.float32) / n))
        if c.rope_scaling:
            inv_freq = llama3_scale_inv_freq(inv_freq, c.rope_scaling)
        freqs = positions.float().unsqueeze(-1) * inv_freq  # [..., T, n/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [..., T, n]
        return emb.cos(), emb.sin()

    def forward(self, idx: torch.Tensor, input_pos: Optional[torch.Tensor] = None, lm_head_chunk: int = 0,
                positions: Optional[torch.Tensor] = None, segments: Optional[torch.Tensor] = None,
                output_mask: Optional[torch.Tensor] = None) -> torch.Tensor | list[torch.Tensor]:
        """idx [B, T] -> logits [B, T, V]. With `input_pos` [T] the KV cache is used (prefill or decode).

        Packed samples (training): `segments` [B, T] numbers the sample each token belongs to (-1: padding) and
        `positions` [B, T] restart at 0 with every sample; attention stays inside each sample. `output_mask` [B, T]:
        only those positions go through the output layer (the ones that have a target), giving logits [N, V]."""
        B, T = idx.shape
        x = self.transformer.wte(idx)  # [B, T, C]
        if self.config.scale_embeddings:
            # Gemma rounds the normalizer to the activation dtype before multiplying
            x = x * torch.tensor(self.config.n_embd**0.5, dtype=x.dtype)
        training = self.training and torch.is_grad_enabled()
        spans = None
        if segments is not None:
            cos, sin = (t.unsqueeze(1) for t in self.rope_cache(positions))  # [B, 1, T, n]: broadcast over heads
            mask, kv_len = None, T
            spans = sample_spans(segments)
            window = self.config.sliding_window_size
            if (training and self.compiled_blocks is not None) or (
                    window is not None and max(n for row in spans for n, _ in row) > window):
                # one mask for the whole batch: a compiled graph would be specialized on every batch's sample
                # lengths, and a sample longer than the sliding window needs the window's mask anyway
                mask, spans = packed_attention_mask(segments, positions, window), None
        else:
            if input_pos is not None and self.kv_caches is None:
                raise RuntimeError("call set_kv_cache() before passing input_pos")
            positions = torch.arange(T, device=idx.device) if input_pos is None else input_pos
            cos, sin = self.rope_cache(positions)
            mask, kv_len = self._mask(positions, T, input_pos is not None, idx.device)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        for i, block in enumerate(self.transformer.h):
            cache = self.kv_caches[i] if input_pos is not None else None
            if training and self.compiled_blocks is not None:
                block = self.compiled_blocks[i]
            if self.activation_checkpointing and training:
                x = torch.utils.checkpoint.checkpoint(block, x, cos, sin, input_pos, cache, mask, kv_len, spans,
                                                      use_reentrant=False)
            else:
                x = block(x, cos, sin, input_pos, cache, mask, kv_len, spans)
        x = self.transformer.ln_f(x)
        if output_mask is not None:
            # Why: prompt and padding positions have no target. Skipping them in the output layer saves its matmuls
            # and, with a large vocabulary, most of the step's peak memory (the logits and their fp32 softmax).
            x, dim, lm_head_chunk = x[output_mask], 0, lm_head_chunk * B  # [N, C]
        else:
            dim = 1
        if lm_head_chunk:
            # the loss upcasts each chunk to fp32 on its own (training.chunked_cross_entropy)
            return [linear(self.lm_head, xc) for xc in x.split(lm_head_chunk, dim=dim)]
        return linear(self.lm_head, x)  # [B, T, V] (or [N, V])

    def compile_blocks(self) -> None:
        """torch.compile each block for training steps (validation and generation stay eager, so decoding with the
        KV cache never triggers a recompilation). dynamic=True: one compilation serves every batch length."""
        cpu_attention.keep_out_of_compiled_graphs()
        self.compiled_blocks = [torch.compile(block, dynamic=True) for block in self.transformer.h]

    def _mask(self, positions: torch.Tensor, T: int, cached: bool, device: torch.device):
        """(mask or None, keys to attend). None means plain causal attention (or no mask for one decode step).

        With the cache only the first `kv_len` cached positions are attended, not the whole preallocated buffer."""
        window = self.config.sliding_window_size
        kv_len = int(positions.max()) + 1 if cached else T
        full_causal = kv_len == T or T == 1  # prefill from position 0, or one new token that sees everything before it
        if full_causal and (window is None or kv_len <= window):
            return None, kv_len
        return attention_mask(positions, kv_len, window, device), kv_len

    def set_kv_cache(self, batch_size: int, max_seq_length: Optional[int] = None,
                     device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None) -> None:
        c = self.config
        max_seq_length = max_seq_length or self.max_seq_length
        ref = self.transformer.ln_f.weight  # activations' dtype (the embedding may be read from a 4-bit head)
        device, dtype = device or ref.device, dtype or ref.dtype
        shape = (batch_size, c.n_query_groups, max_seq_length, c.head_size)
        self.kv_caches = [KVCache(shape, device, dtype) for _ in range(c.n_layer)]

    def clear_kv_cache(self) -> None:
        self.kv_caches = None


class Block(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.norm_1 = make_norm(config, config.n_embd)
        self.attn = CausalSelfAttention(config)
        # parallel blocks with a shared norm (Falcon 7B, Phi) have no second norm
        self.norm_2 = None if config.shared_attention_norm else make_norm(config, config.n_embd)
        self.mlp = GptNeoxMLP(config) if config.mlp_class == "GptNeoxMLP" else LLaMAMLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, input_pos: Optional[torch.Tensor],
                cache: Optional["KVCache"], mask: Optional[torch.Tensor], kv_len: int,
                spans: Optional[list] = None) -> torch.Tensor:
        h = self.norm_1(x)
        attn_out = self.attn(h, cos, sin, input_pos, cache, mask, kv_len, spans)
        if self.config.parallel_residual:
            mlp_in = h if self.norm_2 is None else self.norm_2(x)
            return x + attn_out + self.mlp(mlp_in)
        x = x + attn_out
        return x + self.mlp(self.norm_2(x))


class CausalSelfAttention(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.qkv = nn.Linear(config.n_embd, sum(config.qkv_sizes), bias=config.bias or config.attn_bias)
        self.proj = nn.Linear(config.n_head * config.head_size, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, input_pos: Optional[torch.Tensor],
                cache: Optional["KVCache"], mask: Optional[torch.Tensor], kv_len: int,
                spans: Optional[list] = None) -> torch.Tensor:
        """`spans` (packed samples, `sample_spans`): each sample attends causally to itself alone, one attention
        call per sample, instead of a [T, T] mask over the whole row."""
        c = self.config
        B, T, _ = x.shape
        q, k, v = linear(self.qkv, x).split(c.qkv_sizes, dim=-1)
        q = q.view(B, T, c.n_head, c.head_size).transpose(1, 2)  # [B, H, T, hs]
        k = k.view(B, T, c.n_query_groups, c.head_size).transpose(1, 2)  # [B, G, T, hs]
        v = v.view(B, T, c.n_query_groups, c.head_size).transpose(1, 2)  # [B, G, T, hs]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        if cache is not None:
            k, v = cache.update(input_pos, k, v)  # [B, G, max_seq_length, hs]
            k, v = k[:, :, :kv_len], v[:, :, :kv_len]  # [B, G, L, hs]: only positions written so far
        if spans is None:
            y = self.attend(q, k, v, mask, cache is not None)
        else:
            # Why per sample: a [T, T] mask makes the kernel compute every pair of the row (a sample's tokens against
            # all others, then masked), while causal calls skip what lies above the diagonal: with 4 samples in a
            # row that is about 1/8 of the work. Padding (at a row's end) attends to nothing: zeros, never a target.
            rows = []
            for qr, kr, vr, row in zip(q, k, v, spans):
                lengths = [n for n, _ in row]
                rows.append(torch.cat([
                    qs.new_zeros(qs.shape).unsqueeze(0) if pad
                    else self.attend(qs.unsqueeze(0), ks.unsqueeze(0), vs.unsqueeze(0), None, False)
                    for qs, ks, vs, (_, pad) in zip(qr.split(lengths, 1), kr.split(lengths, 1), vr.split(lengths, 1),
                                                    row)], dim=2))
            y = torch.cat(rows) if len(rows) > 1 else rows[0]  # [B, H, T, hs]
        y = y.transpose(1, 2).reshape(B, T, c.n_head * c.head_size)
        return linear(self.proj, y)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
               cached: bool) -> torch.Tensor:
        """softmax(q k^T / sqrt(hs) + mask) v, causal where there is no mask and more than one query; q [B, H, T, hs],
        k and v [B, G, L, hs]. Picks the fastest kernel for the dtype and device."""
        c, T = self.config, q.size(-2)
        # GQA/MQA: query head j reads kv head j // (H / G), as in the reference implementations
        gqa = c.n_query_groups != c.n_head
        scale = 1.0 / math.sqrt(c.head_size)
        if cpu_half.attention_in_fp32(q, decoding=cached):
            # 16-bit CPU tensors without native 16-bit matmuls, or a decoding step: fp32 kernels are several times
            # faster
            return cpu_half.attention32(q, k, v, mask, mask is None and T > 1, scale, gqa)
        if mask is None and not cached and T > 1 and cpu_attention.usable(q, k, v):
            if gqa:
                rep = c.n_head // c.n_query_groups
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # [B, H, L, hs]
            return cpu_attention.causal_attention(q, k, v, scale)  # same result, faster backward on CPU
        # enable_gqa: the keys and values stay at G heads, not copied to H: less to save for backward, faster
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and T > 1, scale=scale,
                                              enable_gqa=gqa)


def linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """module(x), with a plain dense nn.Linear through cpu_half.linear: fp32 kernels for 16-bit inputs on a CPU
    without native 16-bit matmuls (LoRA and 4-bit layers choose the same way in their own forward)."""
    if type(module) is nn.Linear:
        return cpu_half.linear(x, module.weight, module.bias)
    return module(x)


def sample_spans(segments: torch.Tensor) -> list[list[tuple[int, bool]]]:
    """For rows of packed samples (`segments` [B, T], -1 for padding): per row, the (length, is_padding) of each run
    of one sample, in order."""
    spans = []
    for row in segments.cpu():
        ids, counts = torch.unique_consecutive(row, return_counts=True)
        spans.append([(n, i < 0) for i, n in zip(ids.tolist(), counts.tolist())])
    return spans


def packed_attention_mask(segments: torch.Tensor, positions: torch.Tensor, window: Optional[int]) -> torch.Tensor:
    """Boolean [B, 1, T, T] for rows of packed samples: a token sees the earlier tokens of its own sample (and only
    the last `window` of them). Padding (segment -1) sees the padding before it, so no softmax row is empty."""
    T = segments.size(1)
    idx = torch.arange(T, device=segments.device)
    mask = (segments[:, :, None] == segments[:, None, :]) & (idx[None, :] <= idx[:, None])  # [B, query, key]
    if window is not None:
        mask &= positions[:, None, :] > positions[:, :, None] - window
    return mask.unsqueeze(1)


def attention_mask(positions: torch.Tensor, length: int, window: Optional[int], device: torch.device) -> torch.Tensor:
    """Boolean [T, L] mask: query at position p sees keys 0..p (and only the last `window` of them)."""
    keys = torch.arange(length, device=device)
    mask = keys[None, :] <= positions[:, None]
    if window is not None:
        mask &= keys[None, :] > positions[:, None] - window
    return mask


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first `cos.size(-1)` channels of every head (partial rotary leaves the rest): x [B, H, T, hs]."""
    n = cos.size(-1)
    if n == 0:
        return x
    rot, rest = x[..., :n], x[..., n:]
    x1, x2 = rot.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    rot = rot * cos + rotated * sin
    if not rest.numel():
        return rot
    # Partial rotary: reassembled in x's memory layout (q and k are transposed views of the qkv output), as the full
    # rotary's elementwise ops keep it. Attention then returns its output in that layout too, so the projection's input
    # is a view of what attention saves for backward rather than a copy of it.
    out = torch.empty_like(x)
    out[..., :n] = rot
    out[..., n:] = rest
    return out


def llama3_scale_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1 rope scaling: slow down low frequencies, keep high ones, blend in between."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


class GptNeoxMLP(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, config.intermediate_size, bias=config.bias)
        self.proj = nn.Linear(config.intermediate_size, config.n_embd, bias=config.bias)
        self.activation = config.activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(self.proj, activate(linear(self.fc, x), self.activation))


class LLaMAMLP(nn.Module):
    """Gated MLP: proj(act(fc_1(x)) * fc_2(x)). Gemma is the same with tanh-GELU."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.fc_1 = nn.Linear(config.n_embd, config.intermediate_size, bias=config.bias)
        self.fc_2 = nn.Linear(config.n_embd, config.intermediate_size, bias=config.bias)
        self.proj = nn.Linear(config.intermediate_size, config.n_embd, bias=config.bias)
        self.activation = config.activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(self.proj, gated_activation(linear(self.fc_1, x), linear(self.fc_2, x), self.activation))


def activate(x: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "silu":
        return F.silu(x)
    return F.gelu(x, approximate="tanh" if kind == "gelu_tanh" else "none")


class _GatedActivation(torch.autograd.Function):
    """act(a) * b that keeps only a and b for backward and recomputes act(a) there. Plain autograd would also keep
    act(a): a third [B, T, intermediate] tensor per block, the largest thing training saves (a quarter of a small
    model's activations). The gradients are the same ops autograd runs."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, kind: str) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        ctx.kind = kind
        return activate(a, kind) * b

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        a, b = ctx.saved_tensors
        with torch.enable_grad():
            a_ = a.detach().requires_grad_()
            act = activate(a_, ctx.kind)
        grad_a = torch.autograd.grad(act, a_, grad * b)[0] if ctx.needs_input_grad[0] else None
        grad_b = grad * act.detach() if ctx.needs_input_grad[1] else None
        return grad_a, grad_b, None


def gated_activation(a: torch.Tensor, b: torch.Tensor, kind: str) -> torch.Tensor:
    """act(a) * b (LLaMA's gated MLP), saving less for backward when training."""
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        return _GatedActivation.apply(a, b, kind)
    return activate(a, kind) * b


class RMSNorm(nn.Module):
    """Normalizes in fp32 (as Llama and Gemma do) and casts back before the scale."""

    def __init__(self, size: int, eps: float, unit_offset: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size) if not unit_offset else torch.zeros(size))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        # F.rms_norm is x * rsqrt(mean(x^2) + eps) in one op: bit-identical to spelling it out, and faster
        # (tutorials/performance.md)
        xf = F.rms_norm(x.float(), (x.size(-1),), eps=self.eps)
        if self.unit_offset:  # Gemma scales in fp32 by (1 + w)
            return (xf * (1.0 + self.weight.float())).to(dtype)
        return self.weight * xf.to(dtype)


def make_norm(config: Config, size: int) -> nn.Module:
    if config.norm_class == "RMSNorm":
        return RMSNorm(size, config.norm_eps, config.norm_unit_offset)
    return nn.LayerNorm(size, eps=config.norm_eps)


class KVCache:
    """Preallocated keys and values of one layer: [B, G, max_seq_length, hs]."""

    def __init__(self, shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> None:
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k = self.k.to(k.dtype)
        self.v = self.v.to(v.dtype)
        self.k.index_copy_(2, input_pos, k)
        self.v.index_copy_(2, input_pos, v)
        return self.k, self.v
