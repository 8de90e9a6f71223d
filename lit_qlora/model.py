"""One readable GPT for every family of lit_qlora/families.py (Llama, Mistral, Qwen2/3, Gemma 1/2/3, OLMo 2, SmolLM3,
GPT-NeoX, Falcon, Phi, StableLM, and the mixtures of experts Qwen3-MoE, Mixtral and gpt-oss).

Every difference between the families is a field of `Config`; there are no subclasses per family.
Shapes in comments: B batch, T sequence, C n_embd, H heads, G query groups (kv heads), hs head size.
"""
from __future__ import annotations

import itertools
import math
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

from lit_qlora.config import Config
from lit_qlora.kernels import cpu_attention, cpu_half
from lit_qlora.losses import chunked_cross_entropy, head_cross_entropy


class GPT(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            h=nn.ModuleList(Block(config, i) for i in range(config.n_layer)),
            ln_f=make_norm(config, config.n_embd),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=config.lm_head_bias)
        if config.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight
        self.max_seq_length = config.block_size
        self.kv_caches: Optional[list[KVCache]] = None
        self.activation_checkpointing = False  # recompute each block in backward instead of keeping its activations
        self.compiled_blocks: Optional[list] = None  # set by compile_blocks(): used for training steps only

    @property
    def activation_checkpointing(self) -> bool:
        return self._activation_checkpointing

    @activation_checkpointing.setter
    def activation_checkpointing(self, on: bool) -> None:
        self._activation_checkpointing = on
        for block in self.transformer.h:  # a recomputed block keeps nothing: its MLP has nothing to drop
            if isinstance(block.mlp, LLaMAMLP):
                block.mlp.recompute_proj_input = not on

    def rope_cache(self, positions: torch.Tensor, local: bool = False,
                   lengths: Optional[list[int]] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for the given positions, computed in fp32 like the reference implementations: [T, rope_n_elem]
        for positions [T], [B, T, rope_n_elem] for per-row positions [B, T] (packed samples). `local`: the
        sliding layers' RoPE where the model has one of its own (Gemma 3: another base, no scaling).
        `lengths`: rows of different sequences (the engine's), each row's longrope factors picked by the length
        given for it (what the same call would reach for that sequence alone) instead of the batch's."""
        c = self.config
        base, scaling = (c.rope_local_base, None) if local else (c.rope_base, c.rope_scaling)
        if lengths is not None and scaling and scaling.get("rope_type") == "longrope":
            rows = [self._rope_rows(row, base, scaling, n) for row, n in zip(positions, lengths)]
            return torch.stack([cos for cos, _ in rows]), torch.stack([sin for _, sin in rows])
        # longrope picks its factors by the length this call reaches, as transformers does
        seq_len = int(positions.max()) + 1 if scaling and scaling.get("rope_type") == "longrope" else 0
        return self._rope_rows(positions, base, scaling, seq_len)

    def _rope_rows(self, positions: torch.Tensor, base: float, scaling: Optional[dict],
                   seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq, factor = rope_inv_freq(self.config.rope_n_elem, base, scaling, positions.device, seq_len)
        freqs = positions.float().unsqueeze(-1) * inv_freq  # [..., T, n/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [..., T, n]
        if factor != 1.0:  # yarn / longrope scale cos and sin
            return emb.cos() * factor, emb.sin() * factor
        return emb.cos(), emb.sin()

    def layer_rope(self, i: int) -> Optional[bool]:
        """Which RoPE layer i uses (`Config.layer_rope`): False the model's, True the sliding layers' own, None none."""
        return self.config.layer_rope(i)

    def layer_window(self, i: int) -> Optional[int]:
        """The sliding window of layer i, or None for full attention (`Config.layer_window`)."""
        return self.config.layer_window(i)

    def forward(self, idx: torch.Tensor, input_pos: Optional[torch.Tensor] = None, lm_head_chunk: int = 0,
                positions: Optional[torch.Tensor] = None, segments: Optional[torch.Tensor] = None,
                output_mask: Optional[torch.Tensor] = None, targets: Optional[torch.Tensor] = None,
                reduction: str = "sum", prefixes: Optional[torch.Tensor] = None,
                router_aux: bool = False, temperature: float = 1.0, batch=None) -> torch.Tensor | list | tuple:
        """idx [B, T] -> logits [B, T, V]. With `input_pos` [T] the KV cache is used (prefill or decode). With
        `targets` (of the positions that reach the output layer: [B, T], or [N] under `output_mask`) the summed
        cross entropy instead of the logits, or with reduction "none" each position's, -log p(target) in fp32
        (`output_loss`; `temperature`: of softmax(logits / temperature), GRPO's sampling distribution).

        Packed samples (training): `segments` [B, T] numbers the sample each token belongs to (-1: padding) and
        `positions` [B, T] restart at 0 with every sample; attention stays inside each sample. `prefixes` [B, T]: a
        sample that continues a shared prefix (a preference pair's prompt, then its chosen and its rejected answer,
        each after it) names that prefix's segment (-1: none); its tokens see the whole prefix, then their own sample
        causally, and its positions go on from the prefix's. `output_mask` [B, T]: only those positions go through
        the output layer (the ones that have a target), giving logits [N, V].

        `batch`: one step of the batched engine (lit_qlora.engine.kv.StepBatch): rows of different sequences, each
        at its own positions (`batch.positions` [B, T]) over its own cached keys and values (`batch.caches[i]`,
        whose `update` writes the new ones and returns every row's [B, G, L, hs]), seen through
        `batch.mask(window)` [B, 1, T, L].

        `router_aux` (a mixture of experts): (that output, the routers' load-balancing loss, the expert load [L, E])
        of this forward (`router_aux_loss`; padding, segment -1, not counted)."""
        if router_aux:
            return self._with_routing(idx, input_pos=input_pos, lm_head_chunk=lm_head_chunk, positions=positions,
                                      segments=segments, output_mask=output_mask, targets=targets,
                                      reduction=reduction, prefixes=prefixes, temperature=temperature,
                                      batch=batch)
        B, T = idx.shape
        x = self.transformer.wte(idx)  # [B, T, C]
        if self.config.scale_embeddings:
            # Gemma rounds the normalizer to the activation dtype before multiplying
            x = x * torch.tensor(self.config.n_embd**0.5, dtype=x.dtype)
        training = self.training and torch.is_grad_enabled()
        if batch is not None:
            positions = batch.positions
        elif segments is None:
            if input_pos is not None and self.kv_caches is None:
                raise RuntimeError("call set_kv_cache() before passing input_pos")
            positions = torch.arange(T, device=idx.device) if input_pos is None else input_pos
        per_row = segments is not None or batch is not None  # positions [B, T]: RoPE tables per row
        all_spans = sample_spans(segments, prefixes) if segments is not None else None
        ropes: dict = {}  # layer_rope(i) -> (cos, sin)
        attention: dict = {}  # layer_window(i) -> (mask, kv_len, spans)
        for i, block in enumerate(self.transformer.h):
            kind, window = self.layer_rope(i), self.layer_window(i)
            if kind not in ropes:
                lengths = batch.rope_lengths if batch is not None else None
                ropes[kind] = self._rope_for(kind, positions, per_row, x, lengths)
            if window not in attention:
                if batch is not None:
                    attention[window] = (batch.mask(window), batch.kv_len, None)
                elif segments is not None:
                    attention[window] = self._packed_attention(segments, positions, prefixes, all_spans, window,
                                                               training)
                else:
                    attention[window] = (*self._mask(positions, T, input_pos is not None, idx.device, window), None)
            cos, sin = ropes[kind]
            mask, kv_len, spans = attention[window]
            cache = batch.caches[i] if batch is not None else self.kv_caches[i] if input_pos is not None else None
            if training and self.compiled_blocks is not None:
                block = self.compiled_blocks[i]
            if self.activation_checkpointing and training:
                x = torch.utils.checkpoint.checkpoint(block, x, cos, sin, input_pos, cache, mask, kv_len, spans,
                                                      use_reentrant=False)
            else:
                x = block(x, cos, sin, input_pos, cache, mask, kv_len, spans)
        return self._head(self.transformer.ln_f(x), output_mask, targets, lm_head_chunk, reduction, temperature)

    def _rope_for(self, kind: Optional[bool], positions: torch.Tensor, per_row: bool, x: torch.Tensor,
                  lengths: Optional[list[int]] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of RoPE kind `kind` (`layer_rope`) at `positions`, in x's dtype: [T, n], or [B, 1, T, n] for
        positions per row (broadcast over heads); empty for layers without rotation."""
        if kind is None:  # no rotation: apply_rope leaves q and k as they are
            return x.new_empty(0), x.new_empty(0)
        cos, sin = self.rope_cache(positions, local=kind, lengths=lengths)
        if per_row:
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return cos.to(x.dtype), sin.to(x.dtype)

    def _packed_attention(self, segments: torch.Tensor, positions: torch.Tensor, prefixes: Optional[torch.Tensor],
                          spans: list, window: Optional[int], training: bool) -> tuple:
        """(mask, kv_len, spans) for rows of packed samples: one attention call per sample (`spans`), or one mask for
        the whole batch where it must be."""
        T = segments.size(1)
        if (training and self.compiled_blocks is not None) or (
                window is not None and max(context for row in spans for context in span_contexts(row)) > window):
            # one mask for the whole batch: a compiled graph would be specialized on every batch's sample lengths,
            # and a sample longer than the sliding window needs the window's mask anyway
            return packed_attention_mask(segments, positions, window, prefixes), T, None
        return None, T, spans

    def _head(self, x: torch.Tensor, output_mask: Optional[torch.Tensor], targets: Optional[torch.Tensor],
              lm_head_chunk: int, reduction: str, temperature: float = 1.0) -> torch.Tensor | list:
        """The output layer on the final hidden states x [B, T, C] (see `forward`)."""
        if output_mask is not None:
            # Why: prompt and padding positions have no target. Skipping them in the output layer saves its matmuls
            # and, with a large vocabulary, most of the step's peak memory (the logits and their fp32 softmax).
            x, dim, lm_head_chunk = x[output_mask], 0, lm_head_chunk * x.size(0)  # [N, C]
        else:
            dim = 1
        if targets is not None:
            return self.output_loss(x, targets, lm_head_chunk, reduction=reduction, temperature=temperature)
        if lm_head_chunk:
            # the loss upcasts each chunk to fp32 on its own (losses.chunked_cross_entropy)
            return [self.output(xc) for xc in x.split(lm_head_chunk, dim=dim)]
        return self.output(x)  # [B, T, V] (or [N, V])

    def _with_routing(self, idx: torch.Tensor, **kw) -> tuple[torch.Tensor | list, torch.Tensor, torch.Tensor]:
        """forward(idx, **kw) with every MoE layer keeping its routing for the load-balancing loss. The layers keep it
        for this call only: a block recomputed in backward (activation checkpointing) does not record again."""
        moe = [b.mlp for b in self.transformer.h if isinstance(b.mlp, MoE)]
        for m in moe:
            m.routing = ()
        try:
            out = self(idx, **kw)
            routing = [m.routing for m in moe]
        finally:
            for m in moe:
                m.routing = None
        segments = kw.get("segments")
        keep = None if segments is None else segments.reshape(-1) >= 0
        aux, load = router_aux_loss(routing, self.config.moe_n_expert, keep)
        return out, aux, load

    def output_loss(self, x: torch.Tensor, targets: torch.Tensor, lm_head_chunk: int = 0,
                    ignore_index: int = -100, reduction: str = "sum", temperature: float = 1.0) -> torch.Tensor:
        """Cross entropy of the output layer at the final hidden states x ([B, T, C] or [N, C]): summed, or per
        position (reduction "none", flattened [N]). A frozen dense head (the default) never holds more than one chunk
        of logits (losses.head_cross_entropy); a quantized head or one with a LoRA computes its logits
        `lm_head_chunk` rows at a time and keeps them for backward."""
        x, targets = x.reshape(-1, x.size(-1)), targets.reshape(-1)
        head = self.lm_head
        if type(head) is nn.Linear and head.bias is None and not head.weight.requires_grad:
            return head_cross_entropy(x, head.weight, targets, self.config.final_softcap, ignore_index,
                                      reduction=reduction, temperature=temperature)
        chunks = x.split(lm_head_chunk) if lm_head_chunk else [x]
        return chunked_cross_entropy([self.output(xc) for xc in chunks], targets, ignore_index, reduction, temperature)

    def output(self, x: torch.Tensor) -> torch.Tensor:
        """The output layer, with Gemma 2's final soft-capping."""
        logits = linear(self.lm_head, x)
        cap = self.config.final_softcap
        return logits if cap is None else softcap(logits, cap)

    def compile_blocks(self) -> None:
        """torch.compile each block for training steps (validation and generation stay eager, so decoding with the
        KV cache never triggers a recompilation). dynamic=True: one compilation serves every batch length."""
        cpu_attention.keep_out_of_compiled_graphs()
        self.compiled_blocks = [torch.compile(block, dynamic=True) for block in self.transformer.h]

    def _mask(self, positions: torch.Tensor, T: int, cached: bool, device: torch.device, window: Optional[int]):
        """(mask or None, keys to attend). None means plain causal attention (or no mask for one decode step).

        With the cache only the first `kv_len` cached positions are attended, not the whole preallocated buffer."""
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
    def __init__(self, config: Config, layer: int = 0) -> None:
        super().__init__()
        self.config = config
        self.norm_1 = make_norm(config, config.n_embd) if config.pre_norms else None
        self.attn = CausalSelfAttention(config)
        # parallel blocks with a shared norm (Falcon 7B, Phi) have no second norm
        self.norm_2 = None if config.shared_attention_norm or not config.pre_norms else make_norm(config, config.n_embd)
        if config.is_moe_layer(layer):
            self.mlp = MoE(config)
        else:
            self.mlp = GptNeoxMLP(config) if config.mlp_class == "GptNeoxMLP" else LLaMAMLP(config)
        if config.post_norms:  # Gemma 2/3, OLMo 2: each branch's output is normalized before it is added
            self.post_attention_norm = make_norm(config, config.n_embd)
            self.post_mlp_norm = make_norm(config, config.n_embd)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, input_pos: Optional[torch.Tensor],
                cache: Optional["KVCache"], mask: Optional[torch.Tensor], kv_len: int,
                spans: Optional[list] = None) -> torch.Tensor:
        h = x if self.norm_1 is None else self.norm_1(x)
        attn_out = self.attn(h, cos, sin, input_pos, cache, mask, kv_len, spans)
        if self.config.parallel_residual:
            mlp_in = h if self.norm_2 is None else self.norm_2(x)
            return x + attn_out + self.mlp(mlp_in)
        if self.config.post_norms:
            attn_out = self.post_attention_norm(attn_out)
        x = x + attn_out
        mlp_out = self.mlp(x if self.norm_2 is None else self.norm_2(x))
        if self.config.post_norms:
            mlp_out = self.post_mlp_norm(mlp_out)
        return x + mlp_out


class CausalSelfAttention(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.qkv = nn.Linear(config.n_embd, sum(config.qkv_sizes), bias=config.bias or config.attn_bias)
        self.proj = nn.Linear(config.n_head * config.head_size, config.n_embd, bias=config.bias)
        if config.qk_norm:  # per head (Qwen3, Gemma 3) or over the whole projection (OLMo 2)
            q_size, k_size, _ = config.qkv_sizes
            per_head = config.qk_norm == "head"
            self.q_norm = make_norm(config, config.head_size if per_head else q_size)
            self.k_norm = make_norm(config, config.head_size if per_head else k_size)
        if config.attn_sinks:  # gpt-oss: one learned logit per head in each softmax row (`sink_attention`)
            self.sinks = nn.Parameter(torch.zeros(config.n_head))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, input_pos: Optional[torch.Tensor],
                cache: Optional["KVCache"], mask: Optional[torch.Tensor], kv_len: int,
                spans: Optional[list] = None) -> torch.Tensor:
        """`spans` (packed samples, `sample_spans`): each sample attends causally to itself alone (after its shared
        prefix, if it has one), one attention call per sample, instead of a [T, T] mask over the whole row."""
        c = self.config
        B, T, _ = x.shape
        q, k, v = linear(self.qkv, x).split(c.qkv_sizes, dim=-1)
        if c.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(B, T, c.n_head, c.head_size).transpose(1, 2)  # [B, H, T, hs]
        k = k.view(B, T, c.n_query_groups, c.head_size).transpose(1, 2)  # [B, G, T, hs]
        v = v.view(B, T, c.n_query_groups, c.head_size).transpose(1, 2)  # [B, G, T, hs]
        if v.requires_grad and cache is None:
            # v is the one part of the projection attention keeps as it is (q and k are copied by RoPE): saved as a
            # view, it would keep the whole [B, T, q + k + v] output alive until backward
            v = v.contiguous()
        if c.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        y = None
        if cache is not None:
            if T == 1 and hasattr(cache, "decode"):  # the batched engine's decoding step: attention from its pool
                y = cache.decode(self, q, k, v)
            if y is None:
                k, v = cache.update(input_pos, k, v)  # [B, G, max_seq_length, hs]
                k, v = k[:, :, :kv_len], v[:, :, :kv_len]  # [B, G, L, hs]: only positions written so far
        if y is not None:
            pass
        elif spans is None:
            y = self.attend(q, k, v, mask, cache is not None)
        else:
            # Why per sample: a [T, T] mask makes the kernel compute every pair of the row (a sample's tokens against
            # all others, then masked), while causal calls skip what lies above the diagonal: with 4 samples in a
            # row that is about 1/8 of the work. Padding (at a row's end) attends to nothing: zeros, never a target.
            # A sample after a shared prefix: its queries against the prefix's keys and values and then its own.
            rows = []
            for qr, kr, vr, row in zip(q, k, v, spans):
                lengths = [n for n, _, _ in row]
                qs, ks, vs = qr.split(lengths, 1), kr.split(lengths, 1), vr.split(lengths, 1)
                out = []
                for j, (n, pad, prefix) in enumerate(row):
                    if pad:
                        out.append(qs[j].new_zeros(qs[j].shape).unsqueeze(0))
                    elif prefix is None:
                        out.append(self.attend(qs[j].unsqueeze(0), ks[j].unsqueeze(0), vs[j].unsqueeze(0), None, False))
                    else:
                        m = lengths[prefix]
                        sees = torch.ones(n, m + n, dtype=torch.bool, device=q.device).tril_(m)  # prefix, then causal
                        out.append(self.attend(qs[j].unsqueeze(0), torch.cat([ks[prefix], ks[j]], 1).unsqueeze(0),
                                               torch.cat([vs[prefix], vs[j]], 1).unsqueeze(0), sees, False))
                rows.append(torch.cat(out, dim=2))
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
        scale = c.attention_scale or 1.0 / math.sqrt(c.head_size)
        if c.attn_sinks:
            if cpu_half.attention_in_fp32(q, decoding=cached):  # as below: fp32 kernels where 16-bit ones are slow
                return sink_attention(q.float(), k.float(), v.float(), mask, scale, self.sinks.float()).to(q.dtype)
            return sink_attention(q, k, v, mask, scale, self.sinks)
        if c.attn_softcap is not None:
            return softcapped_attention(q, k, v, mask, scale, c.attn_softcap)
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


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap): Gemma 2's soft-capping of attention and output logits."""
    return torch.tanh(x / cap) * cap


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], scale: float,
                   sinks: torch.Tensor) -> torch.Tensor:
    """Attention with gpt-oss's sinks: each head's softmax row has one more logit, `sinks[h]`, whose value is zero, so a
    query can give part of its attention to nothing (HF: cat the sink column to the logits, softmax, drop it).
    q [B, H, T, hs], k and v [B, G, L, hs]; `mask` boolean [T, L] or [B, 1, T, L], None: causal, aligned to the last
    key (a prefill from position 0 or one decoding step), as everywhere in this module.

    Computed as one more key: k and v get a zero row (q . 0 = 0), and a float mask gives that key the sink logit (and
    -inf where the boolean mask says no), so PyTorch's fused attention does the rest, backward included, and keeps
    only its own softmax statistics for backward instead of a [B, H, T, L] probability matrix."""
    B, H, T, hs = q.shape
    G, L = k.size(1), k.size(2)
    if mask is None:
        mask = torch.ones(T, L, dtype=torch.bool, device=q.device).tril(L - T)
    mask = mask.view(-1, 1, T, L)  # [1 or B, 1, T, L]
    logits = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
    sink = sinks.to(q.dtype).view(1, H, 1, 1).expand(mask.size(0), H, T, 1)
    logits = torch.cat((logits.expand(-1, H, -1, -1), sink), dim=-1)  # [1 or B, H, T, L + 1]
    zero = k.new_zeros(B, G, 1, hs)
    k, v = torch.cat((k, zero), dim=2), torch.cat((v, zero), dim=2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=logits, scale=scale, enable_gqa=G != H)


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
                         scale: float, cap: float) -> torch.Tensor:
    """Attention whose logits are soft-capped before the mask and the softmax (no fused kernel can do that):
    q [B, H, T, hs], k and v [B, G, L, hs]. Without a mask it is causal, aligned to the last key (a prefill from
    position 0 or a single decoding step). Softmax in fp32, as the reference does."""
    rep = q.size(1) // k.size(1)
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = softcap(q @ k.transpose(-2, -1) * scale, cap)  # [B, H, T, L]
    T, L = scores.shape[-2:]
    if mask is None:
        mask = torch.ones(T, L, dtype=torch.bool, device=q.device).tril(L - T)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v


def linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """module(x), with a plain dense nn.Linear through cpu_half.linear: fp32 kernels for 16-bit inputs on a CPU
    without native 16-bit matmuls (LoRA and 4-bit layers choose the same way in their own forward)."""
    if type(module) is nn.Linear:
        return cpu_half.linear(x, module.weight, module.bias)
    return module(x)


def sample_spans(segments: torch.Tensor,
                 prefixes: Optional[torch.Tensor] = None) -> list[list[tuple[int, bool, Optional[int]]]]:
    """For rows of packed samples (`segments` [B, T], -1 for padding; `prefixes` [B, T], see GPT.forward): per row,
    the (length, is_padding, prefix) of each run of one sample, in order; prefix is the number of the earlier run in
    the row that the sample continues, or None."""
    spans = []
    prefix_rows = prefixes.cpu() if prefixes is not None else [None] * segments.size(0)
    for row, prefix_row in zip(segments.cpu(), prefix_rows):
        ids, counts = torch.unique_consecutive(row, return_counts=True)
        ids, counts = ids.tolist(), counts.tolist()
        firsts = [0, *itertools.accumulate(counts)][:-1]
        run_of = {i: j for j, i in enumerate(ids) if i >= 0}
        spans.append([(n, i < 0, None if prefix_row is None or prefix_row[at] < 0 else run_of[int(prefix_row[at])])
                      for i, n, at in zip(ids, counts, firsts)])
    return spans


def span_contexts(row: list[tuple[int, bool, Optional[int]]]) -> list[int]:
    """The keys each run of a `sample_spans` row attends to at most: its length, plus its prefix's."""
    return [n + (row[prefix][0] if prefix is not None else 0) for n, _, prefix in row]


def packed_attention_mask(segments: torch.Tensor, positions: torch.Tensor, window: Optional[int],
                          prefixes: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Boolean [B, 1, T, T] for rows of packed samples: a token sees the earlier tokens of its own sample and, where
    `prefixes` names one, the whole shared prefix before it (and only the last `window` positions of all that).
    Padding (segment -1) sees the padding before it, so no softmax row is empty."""
    T = segments.size(1)
    idx = torch.arange(T, device=segments.device)
    mask = (segments[:, :, None] == segments[:, None, :]) & (idx[None, :] <= idx[:, None])  # [B, query, key]
    if prefixes is not None:
        mask |= (prefixes[:, :, None] >= 0) & (prefixes[:, :, None] == segments[:, None, :])
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


def rope_inv_freq(n: int, base: float, scaling: Optional[dict], device: torch.device,
                  seq_len: int = 0) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [n / 2], factor on cos and sin) of RoPE over `n` channels with the given scaling, as
    transformers computes them: Llama 3.1's (a dict without "rope_type"), linear, yarn or longrope (whose factors
    depend on the length `seq_len` a call reaches)."""
    if n == 0:
        return torch.zeros(0, device=device), 1.0
    dims = torch.arange(0, n, 2, device=device, dtype=torch.float32) / n
    inv_freq = 1.0 / (base ** dims)
    kind = (scaling or {}).get("rope_type", "llama3" if scaling else None)
    if kind is None:
        return inv_freq, 1.0
    if kind == "llama3":
        return llama3_scale_inv_freq(inv_freq, scaling), 1.0
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "yarn":
        return yarn_inv_freq(n, base, scaling, device), yarn_attention_factor(scaling)
    if kind == "longrope":
        s, original = scaling, scaling["original_max_position_embeddings"]
        ext = s["long_factor"] if seq_len > original else s["short_factor"]
        inv_freq = 1.0 / (torch.tensor(ext, dtype=torch.float32, device=device) * base ** dims)
        factor = s.get("attention_factor")
        if factor is None:
            factor = 1.0 if s["factor"] <= 1.0 else math.sqrt(1 + math.log(s["factor"]) / math.log(original))
        return inv_freq, float(factor)
    raise ValueError(f"unknown rope scaling {kind!r}")


def yarn_attention_factor(s: dict) -> float:
    """transformers' default for yarn's cos/sin scaling when the config gives no attention_factor."""
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if s.get("mscale") and s.get("mscale_all_dim"):
        return mscale(s["factor"], s["mscale"]) / mscale(s["factor"], s["mscale_all_dim"])
    return mscale(s["factor"])


def yarn_inv_freq(n: int, base: float, s: dict, device: torch.device) -> torch.Tensor:
    """YaRN: interpolate the low frequencies by `factor`, keep the high ones, blend linearly in between; the blend's
    bounds are the channels that turn beta_fast and beta_slow times over the original context."""
    factor, original = s["factor"], s["original_max_position_embeddings"]

    def channel(rotations: float) -> float:  # the channel that turns `rotations` times over the original context
        return n * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = channel(s["beta_fast"]), channel(s["beta_slow"])
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, n - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(n // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate (divide it by factor)
    pos_freqs = base ** (torch.arange(0, n, 2, device=device, dtype=torch.float32) / n)
    return (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


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
        self.recompute_proj_input = True  # False when GPT recomputes the whole block (activation checkpointing)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = linear(self.fc_1, x), linear(self.fc_2, x)
        h = gated_activation(a, b, self.activation)
        if not (self.recompute_proj_input and h.requires_grad) or torch.compiler.is_compiling():
            return linear(self.proj, h)
        # Why: a LoRA on proj saves its input h for its A gradient, a third [tokens, intermediate] tensor per block
        # beside a and b, which the activation's backward keeps anyway; h = act(a) * b is remade from them in
        # backward instead (one elementwise op a block; bit-identical). 95 MiB of 656 saved on GRPO's benchmark step.
        with saved_as_recomputed(h, lambda: activate(a, self.activation) * b):
            return linear(self.proj, h)


class MoE(nn.Module):
    """A mixture of gated MLPs (Qwen3-MoE, Mixtral, gpt-oss). The router scores every expert for each token (softmax
    in fp32), the token goes through the `moe_top_k` best, and their outputs are summed weighted by those scores
    (renormalized over the top k where the family does: the same numbers as gpt-oss's softmax over the top k
    logits). The router stays a dense Linear under --quantize."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.router = nn.Linear(config.n_embd, config.moe_n_expert, bias=config.moe_bias)
        self.experts = Experts(config)
        self.top_k, self.norm_topk = config.moe_top_k, config.moe_norm_topk
        self.routing: Optional[tuple] = None  # (probs [N, E] fp32, chosen [N, k]) of a forward that asked for them

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        x = x.reshape(B * T, C)
        logits = linear(self.router, x)  # [N, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, chosen = probs.topk(self.top_k, dim=-1)  # [N, k]
        if self.routing is not None:  # GPT.forward(..., router_aux=True) collects them (the load-balancing loss)
            self.routing = (probs, chosen)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return self.experts(x, chosen, weights.to(x.dtype)).view(B, T, C)


def router_aux_loss(routing: list[tuple[torch.Tensor, torch.Tensor]], n_expert: int,
                    keep: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The routers' load-balancing loss of one forward, as transformers computes it for Qwen3-MoE and Mixtral
    (`load_balancing_loss_func`: the Switch Transformer's, pooled over the MoE layers): E * sum_e f_e * P_e, where
    f_e is the share of every layer's (token, top-k choice) pairs that went to expert e, per token (the f_e sum to
    k), and P_e the mean router probability of expert e over the same token rows. Only P_e carries a gradient. k for
    perfectly even routing, up to E when every token goes to the same k experts.

    `routing`: each MoE layer's (probs [N, E] fp32, chosen [N, k]); `keep` [N]: the tokens that count (False:
    padding, as transformers' attention_mask). Returns (the loss, fp32 scalar; the expert load [layers, E]: how many
    of the kept tokens' choices each expert got in each layer)."""
    loads, prob_sum, rows = [], None, 0
    for probs, chosen in routing:
        if keep is not None:
            probs, chosen = probs[keep], chosen[keep]
        flat = chosen.reshape(-1)
        loads.append(probs.new_zeros(n_expert).index_add_(0, flat, probs.new_ones(flat.shape)))
        prob_sum = probs.sum(0) if prob_sum is None else prob_sum + probs.sum(0)
        rows += probs.shape[0]
    if not loads:
        raise ValueError("router_aux_loss needs the routing of at least one MoE layer")
    load = torch.stack(loads)
    if rows == 0:  # nothing but padding: no loss (zero, still connected to the routers)
        return prob_sum.sum() * 0.0, load
    return n_expert * ((load.sum(0) / rows) * (prob_sum / rows)).sum(), load


class Experts(nn.Module):
    """The experts of one MoE layer: one stacked weight [E, out, in] per projection (fc_1 gate, fc_2 up, proj down).

    No loop over tokens: the (token, expert) pairs are sorted by expert, each expert that received tokens runs once
    on all of its tokens, and the weighted outputs are added back to their tokens. An expert without tokens is not
    touched (a quantized one is not dequantized)."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        E, C, inner = config.moe_n_expert, config.n_embd, config.moe_intermediate_size
        bias = config.moe_bias
        self.fc_1, self.fc_2 = ExpertWeights(E, inner, C, bias), ExpertWeights(E, inner, C, bias)
        self.proj = ExpertWeights(E, C, inner, bias)
        self.activation = config.activation
        limit = config.moe_swiglu_limit
        self.swiglu = None if limit is None else (config.moe_swiglu_alpha, limit)  # gpt-oss's clamped SwiGLU

    def forward(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [N, C], chosen [N, k] expert indices, weights [N, k] -> [N, C]."""
        k = chosen.size(1)
        order = chosen.reshape(-1).argsort(stable=True)  # the N*k pairs, grouped by expert
        token = order // k
        counts = torch.bincount(chosen.reshape(-1), minlength=self.fc_1.n_expert).tolist()
        experts = [e for e, n in enumerate(counts) if n]
        sizes = [counts[e] for e in experts]
        routed = x[token]  # [N*k, C]: sizes[i] rows for experts[i], one after the other
        # Each projection of every active expert, as one [N*k, ...] tensor of all of them: what backward keeps is
        # two large tensors per layer, not two small ones per expert (long-lived small tensors between the freed
        # temporaries of the experts, their dequantized weights, fragment the CPU heap: +30-60% peak RSS measured).
        # The gate and up projections read the same rows: one call for both (decoding: one kernel call for all of
        # the active experts' gate and up weights: DecodeExpertWeights, in the 4-bit decode kernel).
        a, b = self.fc_1.many_with(self.fc_2, routed, experts, sizes)
        # The routing weight scales the hidden state before the down projection (the same sum): backward then needs
        # no copy of the [N*k, C] outputs.
        scale = weights.reshape(-1, 1)[order]  # [N*k, 1]
        if self.swiglu is None:
            h = gated_activation(a, b, self.activation, scale)
        else:
            h = clamped_swiglu(a, b, *self.swiglu) * scale
        y = self.proj.many(h, experts, sizes, bias=False)
        proj_bias = getattr(self.proj, "base", self.proj).bias  # (a LoRA on the experts wraps them as `base`)
        if proj_bias is not None:  # gpt-oss: the down projection's bias, weighted as its output is
            y = y + scale * proj_bias[chosen.reshape(-1)[order]].to(y.dtype)
        # back to token order, each token's k outputs summed (index_add_ would keep all the outputs for backward)
        return y[order.argsort()].to(x.dtype).view(*chosen.shape, -1).sum(dim=1)


def per_expert(m: nn.Module):
    """(x, e, bias=True) -> expert e of the stacked projection `m` on its rows x, for one forward: `m` itself, or what
    a LoRA over it prepares once per forward (lit_qlora.lora.LoRAExperts.per_expert)."""
    return m.per_expert() if hasattr(m, "per_expert") else m


def each_expert(run, xs, experts: list[int], bias: bool = True) -> torch.Tensor:
    """`ExpertWeights.many` one expert at a time: run(xs[i], experts[i], bias=bias) for each group of rows, as one
    tensor. The groups are a split of the rows, not slices: the backward of a slice makes a zero tensor of all the
    rows for every expert (most of a step's time with 64 experts), split's concatenates the experts' gradients once
    (and once for the gate and up projections together when they read the same split)."""
    return torch.cat([run(h, e, bias=bias) for h, e in zip(xs, experts)])


class ExpertWeights(nn.Module):
    """One projection of every expert of a layer: `weight` [E, out, in] (and `bias` [E, out], gpt-oss); expert e
    computes x @ weight[e]^T + bias[e]. lit_qlora/quant/quantize.py swaps it for bitsandbytes layers, one per expert."""

    def __init__(self, n_expert: int, out_features: int, in_features: int, bias: bool = False) -> None:
        super().__init__()
        self.n_expert, self.out_features, self.in_features = n_expert, out_features, in_features
        self.weight = nn.Parameter(torch.empty(n_expert, out_features, in_features))
        self.bias = nn.Parameter(torch.empty(n_expert, out_features)) if bias else None

    def forward(self, x: torch.Tensor, e: int, bias: bool = True) -> torch.Tensor:
        """Expert e's x @ weight[e]^T (+ bias[e] unless `bias` is False)."""
        return cpu_half.linear(x, self.weight[e], None if self.bias is None or not bias else self.bias[e])

    def many(self, x: torch.Tensor, experts: list[int], sizes: list[int], bias: bool = True) -> torch.Tensor:
        """x [sum(sizes), in], the rows routed to experts[i] being the i-th group of sizes[i] rows -> [sum(sizes), out],
        each group through its expert (`forward`), in the same order. The quantized form computes all the groups of
        a decoding step in one kernel call (the 4-bit decode kernel's DecodeExpertWeights)."""
        return each_expert(per_expert(self), x.split(sizes), experts, bias)

    def many_with(self, other: nn.Module, x: torch.Tensor, experts: list[int],
                  sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(self.many, other.many) of the same rows: another projection of the same experts (the gate's and the up
        projection's), which the quantized form computes in the same kernel call as its own while decoding."""
        xs = x.split(sizes)
        return each_expert(per_expert(self), xs, experts), each_expert(per_expert(other), xs, experts)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's expert activation: the gate clamped from above and the up projection on both sides at `limit`, then
    (up + 1) * gate * sigmoid(alpha * gate)."""
    gate = gate.clamp(max=limit)
    return (up.clamp(-limit, limit) + 1) * (gate * torch.sigmoid(gate * alpha))


def activate(x: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "silu":
        return F.silu(x)
    return F.gelu(x, approximate="tanh" if kind == "gelu_tanh" else "none")


class _GatedActivation(torch.autograd.Function):
    """act(a) * b (times a per-row `scale`, a MoE's routing weights) that keeps only a and b (and the scale) for
    backward and recomputes act(a) there. Plain autograd would also keep act(a): a third [B, T, intermediate] tensor
    per block, the largest thing training saves (a quarter of a small model's activations). The gradients are the
    same ops autograd runs."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, kind: str, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        ctx.save_for_backward(a, b, scale)
        ctx.kind = kind
        out = activate(a, kind) * b
        return out if scale is None else out * scale

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        a, b, scale = ctx.saved_tensors
        with torch.enable_grad():
            a_ = a.detach().requires_grad_()
            act = activate(a_, ctx.kind)
        g = grad if scale is None else grad * scale
        grad_a = torch.autograd.grad(act, a_, g * b)[0] if ctx.needs_input_grad[0] else None
        grad_b = g * act.detach() if ctx.needs_input_grad[1] else None
        grad_scale = None
        if scale is not None and ctx.needs_input_grad[3]:
            grad_scale = (grad * act.detach() * b).sum(-1, keepdim=True)
        return grad_a, grad_b, None, grad_scale


def saved_as_recomputed(t: torch.Tensor, remake: Callable[[], torch.Tensor]):
    """A context in which whatever autograd saves of the contiguous tensor `t` (t itself or a view of it) is not kept:
    `remake()` (run without gradient) makes t's values again when backward needs them. Every other saved tensor goes
    to the saved-tensor hooks already in place, if any (the context's hooks would else hide it from them)."""
    ptr = t.untyped_storage().data_ptr()
    usable = t.is_contiguous() and t.storage_offset() == 0
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)  # (as torch's AOTAutograd reads it)
    outer = top(True) if top is not None else None

    def pack(saved: torch.Tensor):
        if usable and saved.untyped_storage().data_ptr() == ptr and saved.dtype == t.dtype:
            return _Remade(saved.shape, saved.stride(), saved.storage_offset())
        return saved if outer is None else _Packed(outer[0](saved))

    def unpack(packed):
        if isinstance(packed, _Remade):
            with torch.no_grad():
                return remake().as_strided(packed.shape, packed.stride, packed.offset)
        return outer[1](packed.value) if isinstance(packed, _Packed) else packed

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


class _Remade(NamedTuple):
    shape: torch.Size
    stride: tuple
    offset: int


class _Packed(NamedTuple):
    value: Any  # what the enclosing pack hook made of a saved tensor


def gated_activation(a: torch.Tensor, b: torch.Tensor, kind: str, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """act(a) * b (LLaMA's gated MLP), times `scale` [rows, 1] if given, saving less for backward when training."""
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad or scale is not None and scale.requires_grad):
        return _GatedActivation.apply(a, b, kind, scale)
    return activate(a, kind) * b if scale is None else activate(a, kind) * b * scale


class RMSNorm(nn.Module):
    """Normalizes in fp32 (as Llama and Gemma do) and casts back before the scale."""

    def __init__(self, size: int, eps: float, unit_offset: bool, fp32_scale: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size) if not unit_offset else torch.zeros(size))
        self.eps = eps
        self.unit_offset = unit_offset
        self.fp32_scale = fp32_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        # F.rms_norm is x * rsqrt(mean(x^2) + eps) in one op: bit-identical to spelling it out, and faster
        # (tutorials/performance.md)
        xf = F.rms_norm(x.float(), (x.size(-1),), eps=self.eps)
        if self.unit_offset:  # Gemma scales in fp32 by (1 + w)
            return (xf * (1.0 + self.weight.float())).to(dtype)
        if self.fp32_scale:  # OLMo 2 scales in fp32, then casts
            return (self.weight.float() * xf).to(dtype)
        return self.weight * xf.to(dtype)


def make_norm(config: Config, size: int) -> nn.Module:
    if config.norm_class == "RMSNorm":
        return RMSNorm(size, config.norm_eps, config.norm_unit_offset, config.norm_fp32_scale)
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
