"""Hugging Face <-> lit-qlora weight conversion, streamed one tensor at a time.

Neither direction holds two full copies of the model: HF files are read lazily (safetensors handles or
memory-mapped torch files), every output tensor is built from the few input tensors it needs, and the output
safetensors file is written sequentially after a header computed from shapes alone.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
from safetensors import safe_open

from lit_qlora.checkpoint import (
    DTYPES,
    LIT_CONFIG,
    LIT_WEIGHTS,
    check_checkpoint,
    lit_param_shapes,
    write_safetensors_stream,
)
from lit_qlora.config import Config
from lit_qlora.utils import UserError

# ---- key maps ---------------------------------------------------------------------------------
# Per family: (prefix of HF layer i, {our per-layer suffix: HF per-layer suffix}, {our global key: HF key}).
# The fused qkv is special-cased by `qkv_layout`.
_LLAMA_LAYER = {"norm_1": "input_layernorm", "norm_2": "post_attention_layernorm", "attn.proj": "self_attn.o_proj",
                "mlp.fc_1": "mlp.gate_proj", "mlp.fc_2": "mlp.up_proj", "mlp.proj": "mlp.down_proj"}
_LLAMA_GLOBAL = {"transformer.wte": "model.embed_tokens", "transformer.ln_f": "model.norm", "lm_head": "lm_head"}

FAMILIES: dict[str, dict] = {
    "llama": dict(layer="model.layers.{i}.", map=_LLAMA_LAYER, globals=_LLAMA_GLOBAL, qkv="separate",
                  q_names=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    "gpt_neox": dict(layer="gpt_neox.layers.{i}.",
                     map={"norm_1": "input_layernorm", "norm_2": "post_attention_layernorm",
                          "attn.proj": "attention.dense",
                          "mlp.fc": "mlp.dense_h_to_4h", "mlp.proj": "mlp.dense_4h_to_h"},
                     globals={"transformer.wte": "gpt_neox.embed_in", "transformer.ln_f": "gpt_neox.final_layer_norm",
                              "lm_head": "embed_out"},
                     qkv="interleaved", q_names=("attention.query_key_value",)),
    "falcon": dict(layer="transformer.h.{i}.",
                   map={"norm_1": "input_layernorm", "attn.proj": "self_attention.dense", "mlp.fc": "mlp.dense_h_to_4h",
                        "mlp.proj": "mlp.dense_4h_to_h"},
                   globals={"transformer.wte": "transformer.word_embeddings", "transformer.ln_f": "transformer.ln_f",
                            "lm_head": "lm_head"},
                   qkv="falcon", q_names=("self_attention.query_key_value",)),
    "phi": dict(layer="model.layers.{i}.",
                map={"norm_1": "input_layernorm", "attn.proj": "self_attn.dense", "mlp.fc": "mlp.fc1",
                     "mlp.proj": "mlp.fc2"},
                globals={"transformer.wte": "model.embed_tokens", "transformer.ln_f": "model.final_layernorm",
                         "lm_head": "lm_head"},
                qkv="separate", q_names=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
}
_ARCH_FAMILY = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "llama",
                "GemmaForCausalLM": "llama", "StableLmForCausalLM": "llama", "GPTNeoXForCausalLM": "gpt_neox",
                "FalconForCausalLM": "falcon", "PhiForCausalLM": "phi"}


def family(config: Config) -> dict:
    fam = dict(FAMILIES[_ARCH_FAMILY[config.hf_architecture]])
    falcon_two_norms = config.hf_extra.get("new_decoder_architecture") and not config.shared_attention_norm
    if config.hf_architecture == "FalconForCausalLM" and falcon_two_norms:
        fam["map"] = {**fam["map"], "norm_1": "ln_attn", "norm_2": "ln_mlp"}
    return fam


# ---- qkv layouts ------------------------------------------------------------------------------
# separate: three tensors q, k, v | fused: one tensor already [q | k | v] (Falcon 7B multi-query)
# interleaved: per head [q, k, v] (GPT-NeoX, Falcon MHA) | grouped: per kv head [q .. q, k, v] (Falcon 40B)
def qkv_layout(config: Config) -> str:
    fam = FAMILIES[_ARCH_FAMILY[config.hf_architecture]]["qkv"]
    if fam != "falcon":
        return fam
    if config.hf_extra.get("new_decoder_architecture"):
        return "grouped"
    return "fused" if config.hf_extra.get("multi_query", True) else "interleaved"


def qkv_from_hf(config: Config, layout: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """HF q/k/v projection weight or bias -> our fused [q | k | v] rows."""
    if layout == "separate":
        return torch.cat(parts, dim=0)
    (w,) = parts
    if layout == "fused":
        return w
    hs, H, G = config.head_size, config.n_head, config.n_query_groups
    tail = w.shape[1:]
    per = 1 if layout == "interleaved" else H // G  # queries per kv head
    w = w.reshape(G, per + 2, hs, *tail)
    q = w[:, :per].reshape(H * hs, *tail)
    k = w[:, per].reshape(G * hs, *tail)
    v = w[:, per + 1].reshape(G * hs, *tail)
    return torch.cat((q, k, v), dim=0)


def qkv_to_hf(config: Config, layout: str, fused: torch.Tensor) -> list[torch.Tensor]:
    """Inverse of `qkv_from_hf`: our fused rows -> the HF tensors (in q_names order)."""
    q, k, v = fused.split(config.qkv_sizes, dim=0)
    if layout == "separate":
        return [q.clone(), k.clone(), v.clone()]
    if layout == "fused":
        return [fused.clone()]
    hs, H, G = config.head_size, config.n_head, config.n_query_groups
    tail = fused.shape[1:]
    per = 1 if layout == "interleaved" else H // G
    grouped = torch.cat([q.reshape(G, per, hs, *tail), k.reshape(G, 1, hs, *tail), v.reshape(G, 1, hs, *tail)], dim=1)
    return [grouped.reshape(-1, *tail)]


# ---- the plan: one entry per output tensor ----------------------------------------------------
def hf_to_lit_plan(config: Config) -> list[tuple[str, list[str], Callable[[list[torch.Tensor]], torch.Tensor]]]:
    """[(our key, HF keys it needs, how to build it)] in our state-dict order."""
    fam = family(config)
    plan = []
    for key in lit_param_shapes(config):
        head, _, param = key.rpartition(".")  # e.g. transformer.h.3.attn.qkv / weight
        if head.startswith("transformer.h."):
            i, _, sub = head[len("transformer.h."):].partition(".")
            prefix = fam["layer"].format(i=i)
            if sub == "attn.qkv":
                hf_keys = [f"{prefix}{n}.{param}" for n in fam["q_names"]]
                plan.append((key, hf_keys, lambda parts, _l=qkv_layout(config): qkv_from_hf(config, _l, parts)))
                continue
            hf_keys = [f"{prefix}{fam['map'][sub]}.{param}"]
        else:
            hf_keys = [f"{fam['globals'][head]}.{param}"]
        plan.append((key, hf_keys, lambda parts: parts[0]))
    return plan


def lit_to_hf_plan(config: Config) -> list[tuple[str, str, Optional[int]]]:
    """[(HF key, our key, index into the split qkv or None)]."""
    out = []
    for key, hf_keys, _ in hf_to_lit_plan(config):
        if len(hf_keys) > 1 or key.endswith(("attn.qkv.weight", "attn.qkv.bias")):
            out += [(hk, key, j) for j, hk in enumerate(hf_keys)]
        else:
            out.append((hf_keys[0], key, None))
    return out


# ---- reading HF folders lazily ----------------------------------------------------------------
class HFWeights:
    """Lazy access to the tensors of an HF folder: sharded or not, safetensors or torch .bin."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.key_to_file: dict[str, Path] = {}
        self._open: dict[Path, object] = {}
        files = self._weight_files()
        for f in files:
            for k in self._file_keys(f):
                self.key_to_file.setdefault(k, f)

    def _weight_files(self) -> list[Path]:
        for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
            index = self.folder / index_name
            if index.is_file():
                weight_map = json.loads(index.read_text()).get("weight_map", {})
                files = sorted({self.folder / f for f in weight_map.values()})
                missing = [f.name for f in files if not f.is_file()]
                if missing:
                    raise UserError(f"shard {missing[0]} listed in {index} is missing; download every shard listed in "
                                    f"{index_name} into {self.folder}")
                return files
        files = sorted(self.folder.glob("*.safetensors"))
        files = [f for f in files if f.name != LIT_WEIGHTS and not f.name.startswith("adapter_")]
        if not files:
            files = sorted(self.folder.glob("pytorch_model*.bin"))
        if not files:
            raise UserError(f"no weights in {self.folder} (expected *.safetensors or pytorch_model*.bin next to "
                            "config.json); "
                            "download the model's weight files into that folder")
        return files

    def _handle(self, f: Path):
        if f not in self._open:
            if f.suffix == ".safetensors":
                self._open[f] = safe_open(str(f), framework="pt", device="cpu")
            else:  # zip-format torch files memory-map, so only the tensors we touch are read
                self._open[f] = torch.load(f, map_location="cpu", mmap=True, weights_only=True)
        return self._open[f]

    def _file_keys(self, f: Path) -> list[str]:
        h = self._handle(f)
        return list(h.keys())

    def get(self, key: str) -> torch.Tensor:
        if key not in self.key_to_file:
            raise UserError(f"tensor {key!r} is missing from the weights in {self.folder}; the checkpoint is "
                            "incomplete or "
                            "not of the architecture in config.json: download it again")
        h = self._handle(self.key_to_file[key])
        return h.get_tensor(key) if hasattr(h, "get_tensor") else h[key]

    def dtype(self, key: str) -> torch.dtype:
        h = self._handle(self.key_to_file[key])
        if hasattr(h, "get_slice"):
            return DTYPES[h.get_slice(key).get_dtype()]
        return h[key].dtype

    def close(self) -> None:
        self._open.clear()


# ---- the two directions -----------------------------------------------------------------------
def convert_hf_checkpoint(checkpoint_dir: Path, dtype: Optional[torch.dtype] = None) -> Path:
    """HF folder -> `lit_model.safetensors` + `model_config.json` in the same folder."""
    checkpoint_dir = Path(checkpoint_dir)
    cfg_file = checkpoint_dir / "config.json"
    if not cfg_file.is_file():
        raise UserError(f"{cfg_file} not found; point --checkpoint_dir at a Hugging Face model folder with config.json "
                        "and weights")
    config = Config.from_hf_config(cfg_file)
    config.name = checkpoint_dir.name
    src = HFWeights(checkpoint_dir)
    plan = hf_to_lit_plan(config)
    shapes = lit_param_shapes(config)
    missing = [k for _, ks, _ in plan for k in ks if k not in src.key_to_file]
    if missing:
        raise UserError(f"tensor {missing[0]!r} ({len(missing)} in all) is missing from the weights in "
                        f"{checkpoint_dir}; "
                        "the checkpoint is incomplete or not the architecture in config.json: download it again")
    specs = [(k, shapes[k], dtype or src.dtype(ks[0])) for k, ks, _ in plan]

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        for (key, hf_keys, build), (_, _, dt) in zip(plan, specs):
            t = build([src.get(k) for k in hf_keys])
            yield key, t.to(dt)

    write_safetensors_stream(checkpoint_dir / LIT_WEIGHTS, specs, stream())
    src.close()
    config.save(checkpoint_dir / LIT_CONFIG)
    return checkpoint_dir / LIT_WEIGHTS


def convert_lit_checkpoint(checkpoint_dir: Path, out_dir: Path, weights: Optional[Path] = None) -> Path:
    """Our checkpoint -> HF folder (config.json + model.safetensors) that transformers loads."""
    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    config = Config.from_file(checkpoint_dir / LIT_CONFIG)
    weights = Path(weights or checkpoint_dir / LIT_WEIGHTS)
    out_dir.mkdir(parents=True, exist_ok=True)
    plan = lit_to_hf_plan(config)
    with safe_open(str(weights), framework="pt", device="cpu") as f:
        specs = []
        for hf_key, key, j in plan:
            sl = f.get_slice(key)
            shape = list(sl.get_shape())
            if j is not None and key.endswith(("attn.qkv.weight",
                                               "attn.qkv.bias")) and len(family(config)["q_names"]) > 1:
                shape[0] = config.qkv_sizes[j]
            specs.append((hf_key, torch.Size(shape), DTYPES[sl.get_dtype()]))

        def stream() -> Iterator[tuple[str, torch.Tensor]]:
            cache: dict[str, list[torch.Tensor]] = {}
            for hf_key, key, j in plan:
                if j is None:
                    yield hf_key, f.get_tensor(key)
                    continue
                if key not in cache:
                    cache.clear()  # one fused tensor alive at a time
                    cache[key] = qkv_to_hf(config, qkv_layout(config), f.get_tensor(key))
                yield hf_key, cache[key][j]

        write_safetensors_stream(out_dir / "model.safetensors", specs, stream())
    hf_config = to_hf_config(config)
    # declare the dtype actually written: transformers loads a model in the config's dtype by default
    hf_config["torch_dtype"] = str(specs[0][2]).removeprefix("torch.")
    (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2))
    return out_dir


def to_hf_config(config: Config) -> dict:
    """Our Config -> a transformers config.json dict for `config.hf_architecture`."""
    c = config
    arch = c.hf_architecture
    common = dict(architectures=[arch], vocab_size=c.vocab_size, hidden_size=c.n_embd, num_hidden_layers=c.n_layer,
                  num_attention_heads=c.n_head, max_position_embeddings=c.block_size,
                  tie_word_embeddings=c.tie_embeddings, rope_theta=c.rope_base, torch_dtype="bfloat16")
    if arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "GemmaForCausalLM"):
        model_type = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                      "GemmaForCausalLM": "gemma"}[arch]
        d = dict(common, model_type=model_type, num_key_value_heads=c.n_query_groups, head_dim=c.head_size,
                 intermediate_size=c.intermediate_size, rms_norm_eps=c.norm_eps, hidden_act=_hf_act(c.activation),
                 attention_bias=False)
        if arch == "GemmaForCausalLM":
            d["hidden_activation"] = _hf_act(c.activation)
        if c.rope_scaling:
            d["rope_scaling"] = dict(c.rope_scaling, rope_type="llama3")
        if arch == "MistralForCausalLM":
            d["sliding_window"] = c.sliding_window_size
        if arch == "Qwen2ForCausalLM":
            d.update(use_sliding_window=c.sliding_window_size is not None, sliding_window=c.sliding_window_size)
        return d
    if arch == "StableLmForCausalLM":
        return dict(common, model_type="stablelm", num_key_value_heads=c.n_query_groups,
                    intermediate_size=c.intermediate_size,
                    layer_norm_eps=c.norm_eps, hidden_act=_hf_act(c.activation), use_qkv_bias=c.attn_bias,
                    partial_rotary_factor=c.rotary_percentage, use_parallel_residual=False, qk_layernorm=False)
    if arch == "GPTNeoXForCausalLM":
        return dict(common, model_type="gpt_neox", intermediate_size=c.intermediate_size, layer_norm_eps=c.norm_eps,
                    hidden_act=_hf_act(c.activation), rotary_pct=c.rotary_percentage,
                    partial_rotary_factor=c.rotary_percentage,
                    rotary_emb_base=c.rope_base, use_parallel_residual=c.parallel_residual,
                    attention_bias=c.hf_extra.get("attention_bias", True))
    if arch == "PhiForCausalLM":
        return dict(common, model_type="phi", num_key_value_heads=c.n_query_groups,
                    intermediate_size=c.intermediate_size,
                    layer_norm_eps=c.norm_eps, hidden_act=_hf_act(c.activation),
                    partial_rotary_factor=c.rotary_percentage, qk_layernorm=False)
    if arch == "FalconForCausalLM":
        new = bool(c.hf_extra.get("new_decoder_architecture"))
        return dict(common, model_type="falcon", num_kv_heads=c.n_query_groups, layer_norm_epsilon=c.norm_eps,
                    bias=c.bias,
                    parallel_attn=True, alibi=False, new_decoder_architecture=new,
                    multi_query=c.hf_extra.get("multi_query", True),
                    ffn_hidden_size=c.intermediate_size, activation=_hf_act(c.activation),
                    num_ln_in_parallel_attn=(1 if c.shared_attention_norm else 2) if new else None)
    raise UserError(f"export to {arch} is not supported")


def _hf_act(kind: str) -> str:
    return {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}[kind]


def ensure_converted(checkpoint_dir: Path, quiet: bool = False, verify: bool = False) -> Config:
    """Make sure our checkpoint exists in `checkpoint_dir` (converting an HF folder on first use) and return its config.

    `verify` also checks, from the safetensors header alone, that the weights are whole and match the config
    (`checkpoint.check_checkpoint`): what finetune does before anything heavy loads."""
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        raise UserError(f"checkpoint folder {checkpoint_dir} does not exist; pass --checkpoint_dir with a downloaded "
                        "model folder")
    ours, cfg = checkpoint_dir / LIT_WEIGHTS, checkpoint_dir / LIT_CONFIG
    hf = (checkpoint_dir / "config.json").is_file()
    if not hf and ours.is_file() != cfg.is_file():
        have, lost = (ours, cfg) if ours.is_file() else (cfg, ours)
        raise UserError(f"{checkpoint_dir} is partially converted: {have.name} is there but {lost.name} is missing "
                        "(and there is no config.json to convert from); convert the Hugging Face checkpoint again")
    if not (ours.is_file() and cfg.is_file()):
        if not hf:
            have = ", ".join(sorted(p.name for p in checkpoint_dir.iterdir())[:6]) or "nothing"
            raise UserError(f"{checkpoint_dir} holds no model ({have}); it needs config.json and the weight files of a "
                            "Hugging Face model")
        if not quiet:
            print(f"Converting the Hugging Face checkpoint in {checkpoint_dir} (first use; reused next time) ...",
                  file=sys.stderr)
        convert_hf_checkpoint(checkpoint_dir)
    try:
        config = Config.from_file(cfg)
    except (ValueError, TypeError, AttributeError) as e:  # not JSON, not an object, unexpected values
        raise UserError(f"{cfg} is damaged ({type(e).__name__}: {e}); convert the checkpoint again") from None
    if verify:
        check_checkpoint(checkpoint_dir, config)
    return config


def random_weight(name: str, shape: torch.Size, generator: torch.Generator, std: float = 0.02,
                  device: Optional[torch.device] = None) -> torch.Tensor:
    """One tensor of a random bf16 checkpoint: norms at 1, everything else normal(0, `std`). Works for our names and
    Hugging Face's (both call their norms "*norm*"; ours also "ln_f")."""
    if "norm" in name or "ln_f" in name:
        return torch.ones(shape, dtype=torch.bfloat16, device=device)
    return (torch.randn(shape, generator=generator, device=device) * std).to(torch.bfloat16)


def write_random_checkpoint(folder: Path, config: Config, seed: int = 0, std: float = 0.02) -> None:
    """Our checkpoint with random weights (`random_weight`) in bf16, streamed tensor by tensor, so even a model too
    large for memory can be written: for demos, benchmarks and tests."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    shapes = lit_param_shapes(config)
    write_safetensors_stream(folder / LIT_WEIGHTS, [(k, s, torch.bfloat16) for k, s in shapes.items()],
                             ((k, random_weight(k, s, g, std)) for k, s in shapes.items()))
    config.save(folder / LIT_CONFIG)
