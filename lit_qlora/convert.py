"""Hugging Face <-> lit-qlora weight conversion, streamed one tensor at a time.

Neither direction holds two full copies of the model: HF files are read lazily (safetensors handles or
memory-mapped torch files), every output tensor is built from the few input tensors it needs, and the output
safetensors file is written sequentially after a header computed from shapes alone.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict
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
from lit_qlora.families import TEXT_PARTS, architecture_of, spec
from lit_qlora.readers import load_torch, read_json, safetensors_header
from lit_qlora.utils import UserError


# ---- key maps: from the family spec (lit_qlora/families.py) ----------------------------------
def family(config: Config) -> dict:
    """Weight names of `config`'s architecture: layer (prefix of HF layer i), map (our per-layer module -> HF's),
    globals, qkv (layout) and q_names (the HF q/k/v modules, in order)."""
    return spec(config.hf_architecture).weights(config)


# ---- qkv layouts ------------------------------------------------------------------------------
# separate: three tensors q, k, v | fused: one tensor already [q | k | v] (Falcon 7B multi-query)
# interleaved: per head [q, k, v] (GPT-NeoX, Falcon MHA) | grouped: per kv head [q .. q, k, v] (Falcon 40B)
def qkv_layout(config: Config) -> str:
    return family(config)["qkv"]


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


# ---- experts stored as two fused tensors per layer (gpt-oss; the family spec's `fused_experts`) -----------------
# our parameter -> the suffix of the HF tensor it is read from (MXFP4 blocks and scales: lit_qlora/quant/mxfp4.py)
FUSED_SUFFIX = {"weight": "", "bias": "_bias", "weight_blocks": "_blocks", "weight_scales": "_scales"}
# our expert stack -> (the HF tensor, which half of its interleaved gate | up columns, or None)
FUSED_SOURCE = {"mlp.experts.fc_1": ("gate_up", 0), "mlp.experts.fc_2": ("gate_up", 1),
                "mlp.experts.proj": ("down", None)}


def _fused_dim(param: str) -> int:
    # the HF tensor's output dimension: the columns of a transposed [E, in, out] weight and of a bias [E, out], the
    # rows of MXFP4 blocks [E, out, G, 16] and scales [E, out, G]
    return 1 if param in ("weight_blocks", "weight_scales") else -1


def fused_experts_from_hf(t: torch.Tensor, param: str, half: Optional[int]) -> torch.Tensor:
    """One of our expert tensors from HF's fused one: gate (half 0) or up (half 1) of the interleaved gate_up, or
    down whole (half None); a weight transposed from HF's [E, in, out] to our [E, out, in]."""
    if half is not None:
        t = t[:, half::2] if _fused_dim(param) == 1 else t[..., half::2]
    return t.transpose(1, 2) if param == "weight" else t


def fused_experts_to_hf(parts: list[torch.Tensor], param: str) -> torch.Tensor:
    """The inverse of `fused_experts_from_hf`: [fc_1, fc_2] interleaved into gate_up, or [proj] as down."""
    if param == "weight":
        parts = [p.transpose(1, 2) for p in parts]
    if len(parts) == 1:
        return parts[0]
    if _fused_dim(param) == 1:  # rows: gate row j, then up row j
        return torch.stack(parts, dim=2).flatten(1, 2)
    return torch.stack(parts, dim=-1).flatten(-2)  # columns: gate column j, then up column j


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
            if fam["fused_experts"] and sub in FUSED_SOURCE:  # gpt-oss: two HF tensors per layer hold every expert
                name, half = FUSED_SOURCE[sub]
                plan.append((key, [f"{prefix}{fam['fused_experts'][name]}{FUSED_SUFFIX[param]}"],
                             lambda parts, _p=param, _h=half: fused_experts_from_hf(parts[0], _p, _h)))
                continue
            if sub in fam["experts"]:  # our [E, out, in] stacks the E tensors of HF's experts
                hf_keys = [f"{prefix}{fam['experts'][sub].format(e=e)}.{param}" for e in range(config.moe_n_expert)]
                plan.append((key, hf_keys, torch.stack))
                continue
            if fam["gate_up"] and sub in ("mlp.fc_1", "mlp.fc_2"):  # one HF tensor: fc_1's rows, then fc_2's
                plan.append((key, [f"{prefix}{fam['gate_up']}.{param}"],
                             lambda parts, _half=int(sub == "mlp.fc_2"): parts[0].chunk(2)[_half]))
                continue
            hf_keys = [f"{prefix}{fam['map'][sub]}.{param}"]
        else:
            hf_keys = [f"{fam['globals'][head]}.{param}"]
        plan.append((key, hf_keys, lambda parts: parts[0]))
    return plan


def lit_to_hf_plan(config: Config) -> list[tuple[str, tuple[str, ...], Optional[int]]]:
    """[(HF key, our keys, index into the split qkv or None)]: one key of ours, but two (fc_1, fc_2) whose rows
    one fused HF tensor stacks (Phi-3's gate_up_proj). For stacked experts the index is the expert's."""
    out: dict[str, tuple[tuple[str, ...], Optional[int]]] = {}
    fused = bool(family(config)["fused_experts"])  # (gpt-oss: fc_1 and fc_2 share one HF tensor, joined by name)
    for key, hf_keys, _ in hf_to_lit_plan(config):
        if len(hf_keys) > 1 or key.endswith(("attn.qkv.weight", "attn.qkv.bias")) or (
                is_stacked_experts(key) and not fused):
            out.update({hk: ((key,), j) for j, hk in enumerate(hf_keys)})
        else:
            keys, _ = out.get(hf_keys[0], ((), None))
            out[hf_keys[0]] = (keys + (key,), None)
    return [(hk, keys, j) for hk, (keys, j) in out.items()]


def is_stacked_experts(key: str) -> bool:
    """Whether our tensor `key` stacks the weights of a layer's experts ([E, out, in])."""
    return ".mlp.experts." in key


# ---- reading HF folders lazily ----------------------------------------------------------------
class HFWeights:
    """Lazy access to the tensors of an HF folder: sharded or not, safetensors or torch .bin."""

    def __init__(self, folder: Path, renames: tuple[tuple[str, str], ...] = ()) -> None:
        """`renames`: (prefix in the files, prefix it stands for); with any, only the tensors matching one are seen,
        under their renamed keys (a multimodal folder's text model, families.TEXT_PARTS)."""
        self.folder = Path(folder)
        self.key_to_file: dict[str, Path] = {}
        self._stored: dict[str, str] = {}  # renamed key -> key in its file
        self._open: dict[Path, object] = {}
        files = self._weight_files()
        for f in files:
            for k in self._file_keys(f):
                key = k
                if renames:
                    old, new = next(((o, n) for o, n in renames if k.startswith(o)), (None, None))
                    if old is None:
                        continue
                    key = new + k[len(old):]
                    self._stored[key] = k
                self.key_to_file.setdefault(key, f)

    def _weight_files(self) -> list[Path]:
        for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
            index = self.folder / index_name
            if index.is_file():
                weight_map = read_json(index, dict, fix="download it again").get("weight_map", {})
                if not (isinstance(weight_map, dict) and all(isinstance(f, str) for f in weight_map.values())):
                    raise UserError(f"{index}: weight_map is not an object of file names; download it again")
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
            fix = f"download the model's weight files into {self.folder} again"
            if f.suffix == ".safetensors":
                safetensors_header(f, fix=fix)  # sizes, dtypes, offsets against the file: before safetensors reads it
                try:
                    self._open[f] = safe_open(str(f), framework="pt", device="cpu")
                except Exception as e:  # SafetensorError: what the header check above does not catch
                    raise UserError(f"{f} is damaged ({type(e).__name__}: {e}); {fix}") from None
            else:  # zip-format torch files memory-map, so only the tensors we touch are read
                sd = load_torch(f, "weights file", fix, mmap=True)
                if not (isinstance(sd, dict) and all(isinstance(v, torch.Tensor) for v in sd.values())):
                    raise UserError(f"weights file {f} holds no state dict of tensors; {fix}")
                self._open[f] = sd
        return self._open[f]

    def _file_keys(self, f: Path) -> list[str]:
        h = self._handle(f)
        return list(h.keys())

    def get(self, key: str) -> torch.Tensor:
        if key not in self.key_to_file:
            raise UserError(f"tensor {key!r} is missing from the weights in {self.folder}; the checkpoint is "
                            "incomplete or "
                            "not of the architecture in config.json: download it again")
        h, key = self._handle(self.key_to_file[key]), self._stored.get(key, key)
        return h.get_tensor(key) if hasattr(h, "get_tensor") else h[key]

    def dtype(self, key: str) -> torch.dtype:
        h, key = self._handle(self.key_to_file[key]), self._stored.get(key, key)
        if hasattr(h, "get_slice"):
            name = h.get_slice(key).get_dtype()
            if name not in DTYPES:
                raise UserError(f"tensor {key!r} of {self.key_to_file[key]} has dtype {name}, which this converter "
                                f"does not read ({', '.join(DTYPES)}); use a checkpoint in one of those dtypes")
            return DTYPES[name]
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
    # a multimodal model (config.json read above): its text model's tensors
    part = TEXT_PARTS.get(architecture_of(read_json(cfg_file, dict, fix="fix or re-download config.json")))
    src = HFWeights(checkpoint_dir, part.renames if part else ())
    plan = hf_to_lit_plan(config)
    shapes = lit_param_shapes(config)
    missing = [k for _, ks, _ in plan for k in ks if k not in src.key_to_file]
    fused = next((k for k in src.key_to_file if k.endswith((".experts.gate_up_proj", ".experts.down_proj"))), None)
    if missing and family(config)["fused_experts"]:
        stored = "MXFP4 (_blocks / _scales)" if config.moe_mxfp4 else "dense (no quantization_config)"
        raise UserError(f"tensor {missing[0]!r} ({len(missing)} in all) is missing from the weights in "
                        f"{checkpoint_dir}, whose config.json says the experts are stored {stored}; the checkpoint "
                        "is incomplete, or config.json is not the one of these weights: download it again")
    if missing and fused:
        raise UserError(f"{checkpoint_dir} stores its experts stacked ({fused!r}, transformers' in-memory layout), "
                        "which this converter does not read; save the model again with transformers' save_pretrained "
                        "(it writes one tensor per expert)")
    if missing:
        raise UserError(f"tensor {missing[0]!r} ({len(missing)} in all) is missing from the weights in "
                        f"{checkpoint_dir}; "
                        "the checkpoint is incomplete or not the architecture in config.json: download it again")
    # (MXFP4 bytes are never cast)
    specs = [(k, shapes[k], src.dtype(ks[0]) if src.dtype(ks[0]) == torch.uint8 else dtype or src.dtype(ks[0]))
             for k, ks, _ in plan]

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        for (key, hf_keys, build), (_, shape, dt) in zip(plan, specs):
            parts = [src.get(k) for k in hf_keys]
            try:
                t = build(parts)
            except (RuntimeError, ValueError):  # a split or reshape the config's sizes do not fit
                t = None
            if t is None or tuple(t.shape) != tuple(shape):
                got = ", ".join(f"{k} {tuple(p.shape)}" for k, p in zip(hf_keys, parts))
                raise UserError(f"the weights in {checkpoint_dir} do not fit {cfg_file}: {got} cannot make {key} of "
                                f"shape {tuple(shape)}, the shape its sizes give; the config and the weights are of "
                                "different models (or one is damaged): download the model again")
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
    header, _, _ = safetensors_header(weights)  # sizes, dtypes, offsets checked before anything is written
    plan = lit_to_hf_plan(config)
    fused = bool(family(config)["fused_experts"])

    def join(keys: tuple[str, ...], parts: list[torch.Tensor]) -> torch.Tensor:
        """Our tensors `keys` -> the one HF tensor they make."""
        if fused and is_stacked_experts(keys[0]):
            return fused_experts_to_hf(parts, keys[0].rpartition(".")[2])
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    missing = [k for _, keys, _ in plan for k in keys if k not in header]
    if missing:
        raise UserError(f"{weights} has no tensor {missing[0]!r} ({len(missing)} missing), which {config.name}'s "
                        f"config needs; convert the checkpoint again (delete {weights.name} and rerun)")
    out_dir.mkdir(parents=True, exist_ok=True)
    with safe_open(str(weights), framework="pt", device="cpu") as f:
        specs = []
        for hf_key, keys, j in plan:
            sl = f.get_slice(keys[0])
            shape = list(sl.get_shape())
            shape[0] = sum(f.get_slice(k).get_shape()[0] for k in keys)
            if fused and is_stacked_experts(keys[0]):  # the shape of the joined tensor, joined on meta
                shape = join(keys, [torch.empty(f.get_slice(k).get_shape(), device="meta") for k in keys]).shape
            elif is_stacked_experts(keys[0]):  # one expert's [out, in]
                shape = shape[1:]
            elif j is not None and len(family(config)["q_names"]) > 1:
                shape[0] = config.qkv_sizes[j]
            specs.append((hf_key, torch.Size(shape), DTYPES[sl.get_dtype()]))

        def stream() -> Iterator[tuple[str, torch.Tensor]]:
            cache: dict[str, list[torch.Tensor]] = {}
            for hf_key, keys, j in plan:
                if j is None:
                    yield hf_key, join(keys, [f.get_tensor(k) for k in keys])
                    continue
                (key,) = keys
                if is_stacked_experts(key):
                    if key not in cache:
                        cache.clear()
                        cache[key] = list(f.get_tensor(key).unbind(0))
                    yield hf_key, cache[key][j]
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
    return spec(config.hf_architecture).to_hf(config)


def ensure_converted(checkpoint_dir: Path, quiet: bool = False, verify: bool = False) -> Config:
    """Make sure our checkpoint exists in `checkpoint_dir` (converting an HF folder on first use) and return its config.

    `verify` also checks, from the safetensors header alone, that the weights are whole and match the config
    (`checkpoint.check_checkpoint`): what finetune does before anything heavy loads."""
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        raise UserError(f"checkpoint folder {checkpoint_dir} does not exist; pass --checkpoint_dir with a downloaded "
                        "model folder")
    ours, cfg = checkpoint_dir / LIT_WEIGHTS, checkpoint_dir / LIT_CONFIG
    for p in (ours, cfg):  # a folder or a symlink loop in their place: refused, never converted over
        if os.path.lexists(p) and not os.path.isfile(p):
            raise UserError(f"{p} is not a regular file (a folder or a broken link); move it away and run again")
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
    config = Config.from_file(cfg)  # a UserError naming the file and the field when it is damaged
    if verify:
        check_checkpoint(checkpoint_dir, config)
    if hf:
        check_matches_hf_config(checkpoint_dir, config)
    return config


def check_matches_hf_config(checkpoint_dir: Path, config: Config) -> None:
    """A converted config must be what the folder's config.json maps to (its name and the export-only `hf_extra`
    aside): a model_config.json that says otherwise (a softmax scale a Llama has not, a stale conversion by another
    version) is refused in one line naming the field, never trained or sampled on."""
    hf_file = Path(checkpoint_dir) / "config.json"
    theirs = asdict(Config.from_hf_config(hf_file))
    for key, value in asdict(config).items():
        if key not in ("name", "hf_extra") and theirs.get(key) != value:
            raise UserError(f"{Path(checkpoint_dir) / LIT_CONFIG}: {key} is {value!r}, but {hf_file} gives "
                            f"{theirs.get(key)!r}; the conversion does not belong to its config.json (damaged, or "
                            f"made by another version): delete {LIT_CONFIG} and {LIT_WEIGHTS} there to convert again")


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
