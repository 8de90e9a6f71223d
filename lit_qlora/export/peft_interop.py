"""Our LoRA adapters <-> Hugging Face PEFT LoRA folders (adapter_model.safetensors + adapter_config.json).

Both directions are exact: the exported folder, loaded with `peft.PeftModel.from_pretrained` on the
transformers model, computes what our model with the adapter computes, and an imported PEFT folder computes
in our model what PEFT computes.

Our fused qkv keeps one `lora_A` that stacks [A_q; A_k; A_v] (r rows per enabled part) and one `lora_B`
that stacks the parts' rows. Where transformers has separate q/k/v projections (Llama, Phi, ...) that is
one ordinary LoRA per projection. Where transformers has ONE fused `query_key_value` Linear (GPT-NeoX,
Falcon) the exported LoRA has rank n*r (n = enabled parts): A = the stacked A's, B = block-diagonal with
its rows permuted into the HF row layout, and `rank_pattern`/`alpha_pattern` keep the scaling alpha/r.
Importing such a PEFT LoRA (one A of rank R shared by q, k and v) duplicates A for each of our parts and
de-interleaves B; our own exports are recognised (from the safetensors metadata) and restored as they were.
Phi-3's fused `gate_up_proj` (our mlp.fc_1 and mlp.fc_2) is exported the same way: rank 2r, A = [A_1; A_2],
B = block-diagonal; a PEFT LoRA of rank R on it is, exactly, the same A with B's first and second halves of rows.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from lit_qlora.checkpoint import lit_param_shapes
from lit_qlora.config import Config
from lit_qlora.convert import family, qkv_from_hf, qkv_layout, qkv_to_hf
from lit_qlora.lora import EXPERT_PROJECTIONS, LoRAConfig, is_expert_target, lora_targets
from lit_qlora.readers import MAX_SIZE, check_fields, check_value, load_torch, read_json, safetensors_header
from lit_qlora.utils import UserError, atomic_write

PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_WEIGHTS_BIN = "adapter_model.bin"
PEFT_CONFIG = "adapter_config.json"
_PREFIX = "base_model.model."
_META_KEY = "lit_qlora_lora_config"  # our LoRAConfig, kept in the safetensors metadata of our exports
_QKV = ("query", "key", "value")
# transformers 5 renamed GPT-NeoX's `embed_out` to `lm_head`: exported head LoRAs carry both names, imports accept both
_V5_HEAD = "lm_head"


_GATE_UP = ("mlp.fc_1", "mlp.fc_2")  # our two halves of a fused HF gate_up Linear (family spec's `gate_up`)


def _mlp_names(config: Config) -> tuple[str, ...]:
    return ("mlp.fc", "mlp.proj") if config.mlp_class == "GptNeoxMLP" else ("mlp.fc_1", "mlp.fc_2", "mlp.proj")


def _partner(ours_fc_1: str) -> str:
    """Our mlp.fc_2 beside the mlp.fc_1 that names a fused gate_up LoRA."""
    return ours_fc_1.removesuffix(_GATE_UP[0]) + _GATE_UP[1]


def hf_lora_modules(config: Config) -> list[tuple[str, str, str, Optional[int]]]:
    """Every Linear a LoRA can target: (HF module name, our module name, category, layer or None).

    category is one of query/key/value (separate HF projections), qkv (one fused HF Linear),
    projection, mlp, gate_up (one fused HF Linear over our mlp.fc_1, named by it, and mlp.fc_2), head."""
    fam = family(config)
    fused = qkv_layout(config) != "separate"
    out = []
    for i in range(config.n_layer):
        pre, ours = fam["layer"].format(i=i), f"transformer.h.{i}."
        if fused:
            out.append((pre + fam["q_names"][0], ours + "attn.qkv", "qkv", i))
        else:
            out += [(pre + n, ours + "attn.qkv", cat, i) for cat, n in zip(_QKV, fam["q_names"])]
        out.append((pre + fam["map"]["attn.proj"], ours + "attn.proj", "projection", i))
        mlp = _mlp_names(config)
        if fam["gate_up"]:
            out.append((pre + fam["gate_up"], ours + _GATE_UP[0], "gate_up", i))
            mlp = tuple(m for m in mlp if m not in _GATE_UP)
        out += [(pre + fam["map"][sub], ours + sub, "mlp", i) for sub in mlp if sub in fam["map"]]  # (gpt-oss: none)
    out.append((fam["globals"]["lm_head"], "lm_head", "head", None))
    return out


# ---- export -----------------------------------------------------------------------------------
def export_peft(sd: dict[str, torch.Tensor], lora: LoRAConfig, base_config: Config, out_dir: Path,
                base_model_name_or_path: str = "") -> Path:
    """Write our LoRA tensors `sd` (settings `lora`) as a PEFT LoRA folder for the transformers model of
    `base_config` (`lit_qlora.adapter.Adapter.export_peft` checks the base first)."""
    out_dir = Path(out_dir)
    r = lora.r
    targets = lora_targets(base_config, lora)
    layout = qkv_layout(base_config)
    enabled = [c for c in _QKV if getattr(lora, c)]
    tensors: dict[str, torch.Tensor] = {}
    names: list[str] = []
    rank_pattern: dict[str, int] = {}
    alpha_pattern: dict[str, float] = {}

    for hf_mod, ours, cat, _ in hf_lora_modules(base_config):
        if ours not in targets or (cat in _QKV and cat not in enabled):
            continue
        A, B = _get(sd, ours + ".lora_A"), _get(sd, ours + ".lora_B")
        parts = targets[ours]
        if cat in _QKV:  # this projection's slice of our fused qkv LoRA
            j = enabled.index(cat)
            row = sum(n for _, n in parts[:j])
            A, B = A[j * r:(j + 1) * r], B[row:row + parts[j][1]]
        elif cat == "qkv":  # one fused HF Linear: rank n*r, block-diagonal B in the HF row layout
            fused_b = A.new_zeros(sum(base_config.qkv_sizes), len(parts) * r)
            row = 0
            for j, (start, n) in enumerate(parts):
                fused_b[start:start + n, j * r:(j + 1) * r] = B[row:row + n]
                row += n
            (B,) = qkv_to_hf(base_config, layout, fused_b)
            if len(parts) > 1:
                _fused_rank(hf_mod, len(parts), lora, rank_pattern, alpha_pattern)
        elif cat == "gate_up":  # one fused HF Linear over fc_1 | fc_2: rank 2r, block-diagonal B
            other = _partner(ours)
            A = torch.cat([A, _get(sd, other + ".lora_A")])
            B = torch.block_diag(B, _get(sd, other + ".lora_B"))
            _fused_rank(hf_mod, 2, lora, rank_pattern, alpha_pattern)
        magnitude = _dora_magnitude(sd, ours, cat, parts, enabled, base_config) if lora.dora else None
        for mod in [hf_mod] + ([_V5_HEAD] if cat == "head" and hf_mod != _V5_HEAD else []):
            tensors[f"{_PREFIX}{mod}.lora_A.weight"] = A.float().clone()
            tensors[f"{_PREFIX}{mod}.lora_B.weight"] = B.float().clone()
            if magnitude is not None:
                tensors[f"{_PREFIX}{mod}.lora_magnitude_vector"] = magnitude.clone()
        short = hf_mod.rsplit(".", 1)[-1]
        for n in [short] + ([_V5_HEAD] if cat == "head" else []):
            if n not in names:
                names.append(n)
    params = _export_moe(sd, lora, base_config, tensors, rank_pattern, alpha_pattern)
    if not tensors:
        raise UserError("the adapter targets no layer; train with at least one --lora_* target")

    peft_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_name_or_path or None,
        # PEFT's ParamWrapper (target_parameters) refuses any lora_dropout (training only: it changes no output)
        "r": r, "lora_alpha": lora.alpha, "lora_dropout": 0.0 if params else lora.dropout, "target_modules": names,
        "target_parameters": params or None,
        "rank_pattern": rank_pattern, "alpha_pattern": alpha_pattern, "bias": "none", "fan_in_fan_out": False,
        "use_rslora": lora.rslora, "use_dora": lora.dora, "lora_bias": False, "modules_to_save": None,
        "layers_to_transform": None, "layers_pattern": None, "init_lora_weights": True, "inference_mode": True,
        "revision": None,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"format": "pt", _META_KEY: json.dumps(asdict(lora))}
    atomic_write(out_dir / PEFT_WEIGHTS, lambda p: save_file(tensors, str(p), metadata=meta))
    atomic_write(out_dir / PEFT_CONFIG, lambda p: p.write_text(json.dumps(peft_config, indent=2)))
    return out_dir


# ---- mixtures of experts: PEFT's target_parameters ----------------------------------------------------------
# PEFT (>= 0.17) puts a LoRA on a parameter itself (`target_parameters`, its lora.ParamWrapper). On transformers 5's
# stacked experts, gate_up_proj [E, 2 * inner, C] and down_proj [E, C, inner], it keeps one pair per expert:
# lora_A.weight [E * R, in] (expert e's A in rows e*R .. e*R + R) and lora_B.weight [out, R * E] (expert e's B in
# the columns j*E + e, j < R), and computes W_e + scaling * B_e @ A_e. The router's weight [E, C] is a 2-D parameter:
# an ordinary A [R, C], B [E, R]. Two targeted parameters of one module nest two wrappers, the first one defined
# innermost (its tensors under `.base_layer.`). Our fc_1 and fc_2 share gate_up_proj: exported as one LoRA of rank 2r
# per expert (A = [A_1; A_2], B block-diagonal), as Phi-3's fused gate_up is (rank_pattern / alpha_pattern).
_MOE_ROLES = ("gate_up", "down", "router")  # in the order of the family spec's moe_params (their definition order)


def _moe_params(config: Config, what: str) -> dict:
    """The family's PEFT names of the stacked experts and the router, or a one-line refusal."""
    names = family(config)["moe_params"]
    if names is None:
        raise UserError(f"{what}: PEFT interop of LoRA on the experts or the router of {config.hf_architecture} is not "
                        "implemented (its transformers layout is not mapped); export it merged "
                        "(scripts/export_hf.py), or train without --lora_experts / --lora_router")
    return names


def _moe_wrapper_keys(names: dict, roles: list[str], layer_prefix: str) -> dict[str, str]:
    """role -> the module name PEFT saves the LoRA of that parameter under, for the targeted `roles` of one layer:
    parameters of one module nest, the first defined innermost (`.base_layer` once per wrapper around it)."""
    out = {}
    for role in roles:
        module = names[role].rpartition(".")[0]
        same = [x for x in roles if names[x].rpartition(".")[0] == module]
        out[role] = layer_prefix + module + ".base_layer" * (len(same) - 1 - same.index(role))
    return out


def _export_moe(sd: dict, lora: LoRAConfig, config: Config, tensors: dict, rank_pattern: dict,
                alpha_pattern: dict) -> list[str]:
    """Add the expert and router LoRAs of `sd` to `tensors` in PEFT's layout; returns target_parameters."""
    if not (lora.experts or lora.router):
        return []
    names = _moe_params(config, "PEFT export")
    roles = (["gate_up", "down"] if lora.experts else []) + (["router"] if lora.router else [])
    fam = family(config)
    for i in filter(config.is_moe_layer, range(config.n_layer)):
        keys, ours = _moe_wrapper_keys(names, roles, fam["layer"].format(i=i)), f"transformer.h.{i}.mlp."
        pairs = {}
        if lora.router:
            pairs["router"] = _get(sd, ours + "router.lora_A"), _get(sd, ours + "router.lora_B")
        if lora.experts:
            (A1, B1), (A2, B2), (A3, B3) = ((_get(sd, f"{ours}experts.{n}.lora_A"),
                                             _get(sd, f"{ours}experts.{n}.lora_B")) for n in EXPERT_PROJECTIONS)
            zero = torch.zeros_like(B1)  # [E, inner, r]; per expert B = [[B_1, 0], [0, B_2]]
            gate_up_B = torch.cat([torch.cat([B1, zero], 2), torch.cat([zero, B2], 2)], 1)
            if names.get("interleaved"):  # HF row 2j is the gate's row j, 2j + 1 the up's
                gate_up_B = torch.stack(gate_up_B.chunk(2, 1), 2).flatten(1, 2)
            pairs["gate_up"] = _peft_experts(torch.cat([A1, A2], 1), gate_up_B)
            pairs["down"] = _peft_experts(A3, B3)
        for role, (A, B) in pairs.items():
            tensors[f"{_PREFIX}{keys[role]}.lora_A.weight"] = A.float().contiguous()
            tensors[f"{_PREFIX}{keys[role]}.lora_B.weight"] = B.float().contiguous()
    if lora.experts:
        _fused_rank(names["gate_up"], 2, lora, rank_pattern, alpha_pattern)
    return [names[role] for role in roles]


def _check_moe(peft: PeftFolder, config: Config, found: dict) -> dict:
    """The LoRAs of the folder's target_parameters, taken out of `found` (HF module -> {lora_A, lora_B}) and checked
    against the base: {(layer, role): (A, B, scaling)} in PEFT's layout. Refused in one line: parameters we do not
    map, halves missing, shapes of another model, listed parameters without weights, only some MoE layers adapted."""
    where, pc = peft.where, peft.config
    listed = pc.get("target_parameters") or []
    if not listed:
        return {}
    names = _moe_params(config, where) if config.moe_n_expert else None
    if names is None:
        raise UserError(f"{where} targets parameters {listed} (PEFT's target_parameters), but the base model "
                        f"{config.name or config.hf_architecture} has no experts or router for them; use the base "
                        "model the adapter was made for")
    # as PEFT matches them: a parameter's full name equals an entry or ends with "." + the entry
    def hits(t: str, role: str) -> bool:
        return names[role] == t or names[role].endswith("." + t) or t.endswith("." + names[role])

    for t in listed:
        if not any(hits(t, role) for role in _MOE_ROLES):
            raise UserError(f"{where} targets the parameter {t!r}; lit-qlora maps only the experts' "
                            f"{names['gate_up']} and {names['down']} and the router's {names['router']}: make the "
                            "adapter without it")
    roles = [role for role in _MOE_ROLES if any(hits(t, role) for t in listed)]
    fam, E, C, inner = family(config), config.moe_n_expert, config.n_embd, config.moe_intermediate_size
    shapes = {"gate_up": (C, 2 * inner), "down": (inner, C), "router": (C, E)}  # (in, out)
    out = {}
    for i in filter(config.is_moe_layer, range(config.n_layer)):
        for role, mod in _moe_wrapper_keys(names, roles, fam["layer"].format(i=i)).items():
            ab = found.pop(mod, None)
            if ab is None:
                continue
            if set(ab) != {"lora_A", "lora_B"}:
                missing = "lora_B" if "lora_A" in ab else "lora_A"
                raise UserError(f"{where} has no {missing} weight for {mod}; the adapter is incomplete: save it again")
            A, B = ab["lora_A"], ab["lora_B"]
            in_f, out_f = shapes[role]
            n = 1 if role == "router" else E
            if (A.ndim != 2 or B.ndim != 2 or A.shape[0] % n or A.shape[0] != B.shape[1] or A.shape[1] != in_f
                    or B.shape[0] != out_f):
                raise UserError(f"{where} has {mod} ({names[role]}) LoRA shapes A {tuple(A.shape)}, B "
                                f"{tuple(B.shape)}, which do not fit {n} x [{out_f}, {in_f}] of the base model; use "
                                "the base model the adapter was made for")
            param = fam["layer"].format(i=i) + names[role]
            out[(i, role)] = (A, B, _scaling(pc, param, A.shape[0] // n, where))
    moe_layers = set(filter(config.is_moe_layer, range(config.n_layer)))
    for role in roles:
        layers = {i for i, r in out if r == role}
        if not layers:
            raise UserError(f"{where} lists {names[role]} in target_parameters but holds no LoRA weights for it; the "
                            "adapter is incomplete: save it again")
        if layers != moe_layers:
            raise UserError(f"{where} adapts {names[role]} in layers {sorted(layers)} only, of the MoE layers "
                            f"{sorted(moe_layers)}; lit-qlora adapters cover every layer: make the PEFT adapter for "
                            "every layer")
    return out


def _convert_moe(peft: PeftFolder, config: Config, lit_meta: Optional[dict], lora_sd: dict, ranks: dict) -> None:
    """The checked target_parameters LoRAs (`peft.moe`) into our tensors and their (rank, scaling) into `ranks`. A
    gate_up_proj LoRA of rank R gives fc_1 and fc_2 each rank R with the same A (its first and second halves of
    rows of B), or back the two LoRAs of rank r our own export made of them (block-diagonal)."""
    if not peft.moe:  # a dense model, or no target_parameters: nothing to convert (and no moe_params to read)
        return
    E, inner, r = config.moe_n_expert, config.moe_intermediate_size, int((lit_meta or {}).get("r", 0))
    interleaved = family(config)["moe_params"].get("interleaved")
    moe = {}  # gate_up in our layout: A [E, R, C], B [E, 2 x inner, R] with the gate's rows first
    for (i, role), (A, B, s) in peft.moe.items():
        if role == "gate_up":
            A, B = _our_experts(A, B, E)
            if interleaved:
                B = torch.cat([B[:, 0::2], B[:, 1::2]], 1)
        moe[(i, role)] = A, B, s
    restored = {}  # layer -> the gate_up halves of our own export, if every layer still has them
    for (i, role), (A, B, _) in moe.items():
        if role == "gate_up":
            blocks = r > 0 and A.shape[1] == 2 * r and not (B[:, :inner, r:].count_nonzero().item()
                                                              or B[:, inner:, :r].count_nonzero().item())
            restored[i] = ((A[:, :r], B[:, :inner, :r]), (A[:, r:], B[:, inner:, r:])) if blocks else None
    if not all(restored.values()):
        restored = {}
    for (i, role), (A, B, s) in moe.items():
        ours = f"transformer.h.{i}.mlp."
        if role == "router":
            pairs = {ours + "router": (A, B)}
        elif role == "down":
            pairs = {ours + "experts.proj": _our_experts(A, B, E)}
        else:
            halves = restored.get(i) or ((A, B[:, :inner]), (A, B[:, inner:]))
            pairs = {ours + "experts.fc_1": halves[0], ours + "experts.fc_2": halves[1]}
        for name, (a, b) in pairs.items():
            lora_sd[name + ".lora_A"], lora_sd[name + ".lora_B"] = a, b
            ranks[name] = (a.shape[-2], s)


def _peft_experts(A: torch.Tensor, B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Our per-expert A [E, R, in], B [E, out, R] -> PEFT's lora_A.weight [E * R, in], lora_B.weight [out, R * E]."""
    E, R, _ = A.shape
    return A.reshape(E * R, -1), B.permute(1, 2, 0).reshape(B.shape[1], R * E)


def _our_experts(A: torch.Tensor, B: torch.Tensor, E: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`_peft_experts` undone: PEFT's [E * R, in], [out, R * E] -> A [E, R, in], B [E, out, R]."""
    R = A.shape[0] // E
    return A.reshape(E, R, -1), B.reshape(B.shape[0], R, E).permute(2, 0, 1)


def _fused_rank(hf_mod: str, n: int, lora: LoRAConfig, rank_pattern: dict, alpha_pattern: dict) -> None:
    """One fused HF Linear carries n of our LoRAs side by side: rank n*r with the same scaling, alpha/r =
    n*alpha / (n*r), or rsLoRA's alpha/sqrt(r) = sqrt(n)*alpha / sqrt(n*r)."""
    short = hf_mod.rsplit(".", 1)[-1]
    rank_pattern[short] = n * lora.r
    alpha_pattern[short] = math.sqrt(n) * lora.alpha if lora.rslora else n * lora.alpha


def _dora_magnitude(sd: dict, ours: str, cat: str, parts: list, enabled: list, config: Config) -> torch.Tensor:
    """PEFT's lora_magnitude_vector of one HF module: our magnitudes of its rows (in the HF row order)."""
    m = _get(sd, ours + ".lora_magnitude")
    if cat in _QKV:
        j = enabled.index(cat)
        row = sum(n for _, n in parts[:j])
        return m[row:row + parts[j][1]]
    if cat == "qkv":  # every row of the fused Linear has a magnitude in PEFT: only whole qkv LoRAs map exactly
        if len(parts) != len(_QKV):
            raise UserError("a DoRA adapter on some of q/k/v cannot be exported to this model's fused "
                            "query_key_value (PEFT keeps a magnitude for every row); train it with --lora_query, "
                            "--lora_key and --lora_value all true")
        (hf,) = qkv_to_hf(config, qkv_layout(config), m[:, None])
        return hf[:, 0]
    if cat == "gate_up":
        return torch.cat([m, _get(sd, _partner(ours) + ".lora_magnitude")])
    return m


def _get(sd: dict, key: str) -> torch.Tensor:
    if key not in sd:
        raise UserError(f"adapter tensor {key} is missing; the adapter file is incomplete: use another checkpoint of "
                        "it")
    return sd[key].detach().float().cpu()


# ---- import: read, check, convert ---------------------------------------------------------------
_MAGNITUDE = ".lora_magnitude_vector"
_KEY_RE = re.compile(r"^(?P<mod>.+)\.(?P<ab>lora_A|lora_B)(?:\.[^.]+)?\.weight$")


@dataclass
class PeftFolder:
    """What a PEFT LoRA folder holds, as read from disk."""

    config: dict  # adapter_config.json
    tensors: dict[str, torch.Tensor]
    metadata: dict  # safetensors metadata (our own exports record their LoRAConfig there)
    where: str  # how error messages name it
    magnitudes: dict = field(default_factory=dict)  # DoRA: HF module -> lora_magnitude_vector (filled by check_peft)
    moe: dict = field(default_factory=dict)  # (layer, gate_up / down / router) -> (A, B, scaling) (check_peft)


def import_peft(folder: Path, base_config: Config) -> tuple[dict[str, torch.Tensor], LoRAConfig, dict]:
    """A PEFT LoRA folder for the transformers model of `base_config` -> (our LoRA tensors, LoRAConfig, train info),
    the pieces of a `lit_qlora.adapter.Adapter`."""
    peft = read_peft(folder)
    mods = check_peft(peft, base_config)
    tensors, lora = convert_peft(peft, mods, base_config)
    train = {"source": "peft", "path": str(folder),
             "base_model_name_or_path": peft.config.get("base_model_name_or_path")}
    return tensors, lora, train


def read_peft(folder: Path) -> PeftFolder:
    """adapter_config.json (refusing what we cannot represent) and the adapter weights."""
    folder = Path(folder)
    pc = _read_peft_config(folder)
    tensors, meta = _read_peft_weights(folder)
    made_for = pc.get("base_model_name_or_path")
    return PeftFolder(pc, tensors, meta, f"PEFT adapter {folder}" + (f" (made for {made_for})" if made_for else ""))


def check_peft(peft: PeftFolder, base_config: Config) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """Every LoRA of the folder checked against the base model: {HF module: (A [R, in], B [out, R], scaling)}.

    Refused in one line: tensors that are not LoRA A/B weights, modules the base has no Linear for, missing halves,
    shapes of another model, target_modules without weights, LoRAs on only some layers."""
    where, pc = peft.where, peft.config
    base_name = base_config.name or base_config.hf_architecture
    universe = _universe(base_config)
    base_copies = _base_weight_names(base_config, universe)
    found: dict[str, dict[str, torch.Tensor]] = {}  # HF module -> {"lora_A": ..., "lora_B": ...}
    for key, t in peft.tensors.items():
        k = key[len(_PREFIX):] if key.startswith(_PREFIX) else key
        if k.endswith(_MAGNITUDE):  # DoRA
            peft.magnitudes[k.removesuffix(_MAGNITUDE)] = t.detach().float()
            continue
        m = _KEY_RE.match(k)
        if not m:
            # PEFT's copy of an untouched base weight (save_embedding_layers): not part of the LoRA
            if k in base_copies:
                if tuple(t.shape) != tuple(base_copies[k]):
                    raise UserError(f"{where} holds {k} of shape {tuple(t.shape)} but the base model {base_name} has "
                                    f"{tuple(base_copies[k])}; use the base model the adapter was made for")
                continue
            raise UserError(f"{where} holds {key!r}, which is not a LoRA A/B weight (bias, embedding LoRA or "
                            "modules_to_save are not supported); save the adapter with bias='none' and only Linear "
                            "targets")
        found.setdefault(m["mod"], {})[m["ab"]] = t.detach().float()
    peft.moe = _check_moe(peft, base_config, found)  # (takes the expert and router LoRAs out of `found`)
    for mod, ab in found.items():
        if mod not in universe:
            layer = re.search(r"\.(\d+)\.", mod)
            if layer and int(layer[1]) >= base_config.n_layer:
                raise UserError(f"{where} adapts layer {layer[1]} ({mod}) but the base model {base_name} has "
                                f"{base_config.n_layer} layers; use the base model the adapter was made for")
            raise UserError(f"{where} adapts {mod}, which the base model {base_name} ({base_config.hf_architecture}) "
                            "has no Linear layer of that name for; use the base model the adapter was made for")
        for ab_name in ("lora_A", "lora_B"):
            if ab_name not in ab:
                raise UserError(f"{where} has no {ab_name} weight for {mod}; the adapter is incomplete: save it again")
    if not found and not peft.moe:
        raise UserError(f"{where} holds no LoRA weights; save the adapter again with save_pretrained")

    shapes = _weight_shapes(base_config)
    mods: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
    for mod, ab in found.items():
        ours, cat, _ = universe[mod]
        A, B = ab["lora_A"], ab["lora_B"]
        out_f, in_f = shapes[ours + ".weight"]
        if cat in _QKV:
            out_f = base_config.qkv_sizes[_QKV.index(cat)]
        elif cat == "gate_up":
            out_f = 2 * out_f
        if A.ndim != 2 or B.ndim != 2 or A.shape[0] != B.shape[1] or A.shape[1] != in_f or B.shape[0] != out_f:
            raise UserError(f"{where} has {mod} LoRA shapes A {tuple(A.shape)}, B {tuple(B.shape)} but the base model "
                            f"{base_name} has that layer as [{out_f}, {in_f}]; use the base model the adapter was made "
                            "for")
        mods[mod] = (A, B, _scaling(pc, mod, A.shape[0], where))

    # which of our targets are on, per layer; every layer must agree
    by_cat = _layers_by_category(mods, universe)
    layer_sets = {frozenset(v) for k, v in by_cat.items() if k != "head"}
    only = set(next(iter(layer_sets))) if len(layer_sets) == 1 else set()
    if pc.get("layers_to_transform") is None and only == set(range(len(only))) and 0 < len(only) < base_config.n_layer:
        raise UserError(f"{where} adapts {len(only)} layers but the base model {base_name} has {base_config.n_layer}; "
                        "use the base model the adapter was made for")
    found_targets = {universe[m][:2] for m in found}
    for mod in _expected_modules(pc, universe):
        if universe[mod][:2] not in found_targets:  # (a head found under its other name counts)
            raise UserError(f"{where} lists {mod} in target_modules but holds no LoRA weights for it; "
                            "the adapter is incomplete: save it again")
    for key, layers in by_cat.items():
        if key != "head" and layers != set(range(base_config.n_layer)):
            raise UserError(f"{where} adapts {key.split(':')[-1]} in layers {sorted(layers)} only, of the "
                            f"{base_config.n_layer} layers of {base_name}; lit-qlora adapters cover every layer: "
                            "make the PEFT adapter without layers_to_transform (the same target_modules in every "
                            "layer)")
    return mods


def convert_peft(peft: PeftFolder, mods: dict[str, tuple[torch.Tensor, torch.Tensor, float]],
                 base_config: Config) -> tuple[dict[str, torch.Tensor], LoRAConfig]:
    """Checked PEFT LoRAs -> our tensors in our layout (fused qkv, one r and alpha) and the LoRAConfig."""
    universe = _universe(base_config)
    by_cat = _layers_by_category(mods, universe)
    fused = "qkv" in by_cat
    lit_meta = _lit_meta(peft.metadata, peft.where)
    flags = dict(query=fused or "query" in by_cat, key=fused or "key" in by_cat, value=fused or "value" in by_cat,
                 projection="projection" in by_cat, mlp=any(k.startswith("mlp:") for k in by_cat),
                 head="head" in by_cat, experts=any(role != "router" for _, role in peft.moe),
                 router=any(role == "router" for _, role in peft.moe))
    by_ours = _by_our_module(mods, universe, peft.where)
    lora_sd, ranks = _our_pairs(by_ours, mods, base_config, lit_meta, flags, peft.where)
    _convert_moe(peft, base_config, lit_meta, lora_sd, ranks)
    r, s = _check_uniform(list(ranks.values()), peft.where, None)
    lora = _lora_config(peft, lit_meta, r, s, flags)
    if lora.dora:
        lora_sd.update(_our_magnitudes(peft, by_ours, base_config))
    targets = lora_targets(base_config, lora)
    _add_inert_pairs(lora_sd, targets, _weight_shapes(base_config), r, lora.dora, peft.where)
    extra = set(k.rsplit(".", 1)[0] for k in lora_sd) - set(targets)
    assert not extra, f"internal error: LoRA tensors for {sorted(extra)} outside the targets"
    return {k: v.contiguous() for k, v in lora_sd.items()}, lora


def _by_our_module(mods: dict, universe: dict, where: str) -> dict[str, dict[str, str]]:
    """Our module -> {HF category: the PEFT module adapting it}; a tied head adapted twice must hold one LoRA."""
    by_ours: dict[str, dict[str, str]] = {}
    for mod in mods:
        ours, cat, _ = universe[mod]
        other = by_ours.setdefault(ours, {}).setdefault(cat, mod)
        if other != mod and not all(torch.equal(x, y) for x, y in zip(mods[mod][:2], mods[other][:2])):
            raise UserError(f"{where} holds two different LoRAs for the output head ({other} and {mod}); keep only one")
    return by_ours


def _our_pairs(by_ours: dict, mods: dict, base_config: Config, lit_meta: Optional[dict], flags: dict,
               where: str) -> tuple[dict[str, torch.Tensor], dict[str, tuple[int, float]]]:
    """(our lora_A / lora_B tensors, our module -> (r, scaling)) of the PEFT LoRAs on Linear modules. A fused HF qkv
    or gate_up that our own export wrote (block-diagonal, every layer) comes back as the LoRAs it was, its flags
    into `flags`."""
    layout = qkv_layout(base_config)
    fused_qkv = {ours: mods[cats["qkv"]] for ours, cats in by_ours.items() if "qkv" in cats}
    fused_qkv = {ours: (A, qkv_from_hf(base_config, layout, [B_hf]), s) for ours, (A, B_hf, s) in fused_qkv.items()}
    restored = {ours: _block_diagonal(base_config, lit_meta, A, B) for ours, (A, B, _) in fused_qkv.items()}
    if restored and all(v is not None for v in restored.values()):
        flags.update(next(iter(restored.values()))[3])
    else:
        restored = {}
    halves = {ours: _gate_up_halves(lit_meta, *mods[cats["gate_up"]][:2]) for ours, cats in by_ours.items()
              if "gate_up" in cats}
    if not all(v is not None for v in halves.values()):
        halves = {}
    lora_sd: dict[str, torch.Tensor] = {}
    ranks: dict[str, tuple[int, float]] = {}
    for ours, cats in by_ours.items():
        if "qkv" in cats:  # one fused HF Linear; B rows in our order [q | k | v]
            pairs = [(ours, *_qkv_pair(fused_qkv[ours], restored.get(ours)))]
        elif "gate_up" in cats:  # one fused HF Linear: fc_1 has its first half of rows, fc_2 the second
            A, B, s = mods[cats["gate_up"]]
            (A1, B1), (A2, B2) = halves.get(ours) or ((A, B[:B.shape[0] // 2]), (A, B[B.shape[0] // 2:]))
            pairs = [(ours, A1, B1, A1.shape[0], s), (_partner(ours), A2, B2, A2.shape[0], s)]
        elif any(c in _QKV for c in cats):  # separate HF projections: stack them
            mlist = [mods[cats[c]] for c in _QKV if c in cats]
            _check_uniform([(m[0].shape[0], m[2]) for m in mlist], where, ours)
            pairs = [(ours, torch.cat([m[0] for m in mlist]), torch.cat([m[1] for m in mlist]), mlist[0][0].shape[0],
                      mlist[0][2])]
        else:
            A, B, s = mods[next(iter(cats.values()))]
            pairs = [(ours, A, B, A.shape[0], s)]
        for name, A, B, r, s in pairs:
            lora_sd[name + ".lora_A"], lora_sd[name + ".lora_B"] = A, B
            ranks[name] = (r, s)
    return lora_sd, ranks


def _qkv_pair(fused: tuple, restored: Optional[tuple]) -> tuple[torch.Tensor, torch.Tensor, int, float]:
    """(A, B, r, scaling) of our qkv from a fused HF qkv LoRA: our own export restored, or a LoRA with one A shared
    by q, k and v, which gives each of our three parts the same A."""
    A, B, s = fused
    if restored is not None:
        A, B, r, _ = restored
        return A, B, r, s
    return torch.cat([A, A, A]), B, A.shape[0], s


def _lora_config(peft: PeftFolder, lit_meta: Optional[dict], r: int, s: float, flags: dict) -> LoRAConfig:
    """Our LoRAConfig of a PEFT adapter of rank r and scaling s, keeping what our own export recorded of how it was
    trained (the exact alpha, the dropout, LoRA+'s ratio: PEFT's config has no place for them)."""
    rslora = bool(peft.config.get("use_rslora"))
    alpha = s * math.sqrt(r) if rslora else s * r  # the scaling s as alpha / sqrt(r) or alpha / r
    lora = LoRAConfig(r=r, alpha=alpha, dropout=float(peft.config.get("lora_dropout") or 0.0), rslora=rslora,
                      dora=bool(peft.config.get("use_dora")), **flags)
    if lit_meta is None:
        return lora
    if math.isclose(lit_meta.get("alpha", float("nan")), alpha, rel_tol=1e-12):
        lora.alpha = lit_meta["alpha"]  # keep the exact number (e.g. an int) it was trained with
    if peft.moe:  # (target_parameters made our export write lora_dropout 0)
        lora.dropout = float(lit_meta.get("dropout", lora.dropout))
    if lit_meta.get("loraplus_lr_ratio") is not None:
        lora.loraplus_lr_ratio = lit_meta["loraplus_lr_ratio"]
    return lora


def _add_inert_pairs(lora_sd: dict, targets: dict, shapes: dict, r: int, dora: bool, where: str) -> None:
    """MLP layers the PEFT adapter leaves alone (e.g. only down_proj adapted): an inert LoRA, A = B = 0."""
    for name, parts in targets.items():
        if name + ".lora_A" in lora_sd:
            continue
        if dora:  # an inert DoRA layer needs the base's row norms as magnitudes, which the folder has not
            raise UserError(f"{where} is a DoRA adapter that leaves {name} alone while adapting others of its "
                            "kind; lit-qlora adapts all of them: make the adapter with every MLP Linear targeted")
        if is_expert_target(name):  # e.g. only down_proj adapted: fc_1 and fc_2 inert
            E, out_f, in_f = shapes[name + ".weight"]
            lora_sd[name + ".lora_A"], lora_sd[name + ".lora_B"] = torch.zeros(E, r, in_f), torch.zeros(E, out_f, r)
            continue
        out_f, in_f = shapes[name + ".weight"]
        lora_sd[name + ".lora_A"] = torch.zeros(len(parts or [None]) * r, in_f)
        lora_sd[name + ".lora_B"] = torch.zeros(sum(n for _, n in parts) if parts else out_f, r)


def _our_magnitudes(peft: PeftFolder, by_ours: dict[str, dict[str, str]], config: Config) -> dict[str, torch.Tensor]:
    """DoRA's magnitudes in our layout: our module + ".lora_magnitude" -> one per row of its lora_B."""
    def get(mod: str) -> torch.Tensor:
        if mod not in peft.magnitudes:
            raise UserError(f"{peft.where} is a DoRA adapter without lora_magnitude_vector for {mod}; the adapter is "
                            "incomplete: save it again")
        return peft.magnitudes[mod]

    out = {}
    for ours, cats in by_ours.items():
        if "qkv" in cats:
            out[ours + ".lora_magnitude"] = qkv_from_hf(config, qkv_layout(config), [get(cats["qkv"])[:, None]])[:, 0]
        elif "gate_up" in cats:
            m = get(cats["gate_up"])
            out[ours + ".lora_magnitude"], out[_partner(ours) + ".lora_magnitude"] = m.chunk(2)
        elif any(c in _QKV for c in cats):
            out[ours + ".lora_magnitude"] = torch.cat([get(cats[c]) for c in _QKV if c in cats])
        else:
            out[ours + ".lora_magnitude"] = get(next(iter(cats.values())))
    return out


def _universe(config: Config) -> dict[str, tuple[str, str, Optional[int]]]:
    """HF module -> (our module, category, layer) for every Linear a LoRA can target (both names of a NeoX head)."""
    universe = {hf: (ours, cat, i) for hf, ours, cat, i in hf_lora_modules(config)}
    universe.setdefault(_V5_HEAD, ("lm_head", "head", None))
    return universe


def _weight_shapes(config: Config) -> dict[str, torch.Size]:
    shapes = lit_param_shapes(config)
    shapes.setdefault("lm_head.weight", torch.Size((config.vocab_size, config.n_embd)))  # a tied head
    return shapes


def _layers_by_category(mods: dict, universe: dict) -> dict[str, set]:
    """Category (query, key, value, qkv, projection, mlp:<name>, head) -> the layers adapted."""
    by_cat: dict[str, set] = {}
    for mod in mods:
        _, cat, i = universe[mod]
        key = cat if cat not in ("mlp", "gate_up") else f"mlp:{mod.rsplit('.', 1)[-1]}"
        by_cat.setdefault(key, set()).add(i)
    return by_cat


def _base_weight_names(config: Config, universe: dict) -> dict[str, torch.Size]:
    """HF names (and shapes) of the base weights PEFT may save beside a LoRA: the embedding and the head, whose
    weight it stores when the head (often tied to the embedding) is a target."""
    fam = family(config)
    emb = (config.vocab_size, config.n_embd)
    names = {f"{fam['globals']['transformer.wte']}.weight": emb}
    for mod, (ours, cat, _) in universe.items():
        if cat == "head":
            names[f"{mod}.weight"] = names[f"{mod}.base_layer.weight"] = emb
    return {k: torch.Size(v) for k, v in names.items()}


_PEFT_FIELDS = {"peft_type": "str", "r": "size", "lora_alpha": "positive", "lora_dropout": "fraction",
                "rank_pattern": "object", "alpha_pattern": "object", "use_rslora": "bool", "use_dora": "bool",
                "base_model_name_or_path": "str", "bias": "str", "modules_to_save": "list"}


def _read_peft_config(folder: Path) -> dict:
    path = folder / PEFT_CONFIG
    if not path.is_file():
        raise UserError(f"{folder} has no {PEFT_CONFIG}; pass a PEFT adapter folder (saved with save_pretrained) or a "
                        ".pth adapter file")
    fix = "save the adapter again with PEFT's save_pretrained"
    # peft_type required, as PEFT's own PeftConfig.from_pretrained requires it (every save_pretrained writes it)
    pc = check_fields(read_json(path, dict, "PEFT adapter config", fix), path, _PEFT_FIELDS, ("peft_type",), fix=fix)
    # the rank and alpha are the adapter's math: PEFT's save_pretrained always writes them, so one left out (PEFT
    # would take its default, 8) or null is a damaged file, as is an alpha no adapter uses (it scales B A by alpha / r)
    if pc.get("peft_type") == "LORA":
        check_fields(pc, path, {"r": "size", "lora_alpha": "positive"}, ("r", "lora_alpha"), fix=fix, nullable=False)
        check_value(pc["lora_alpha"] <= MAX_SIZE, path, "lora_alpha", pc["lora_alpha"], f"at most {MAX_SIZE}", fix)
    tm = pc.get("target_modules")
    check_value(tm is None or isinstance(tm, str) or (isinstance(tm, list) and all(isinstance(t, str) for t in tm)),
                path, "target_modules", tm, "a module name, a regex or a list of names", fix)
    tp = pc.get("target_parameters")
    check_value(tp is None or (isinstance(tp, list) and all(isinstance(t, str) for t in tp)), path,
                "target_parameters", tp, "a list of parameter names", fix)
    layers = pc.get("layers_to_transform")
    check_value(layers is None or (isinstance(layers, int) and not isinstance(layers, bool) and layers >= 0)
                or (isinstance(layers, list) and all(isinstance(i, int) and i >= 0 for i in layers)),
                path, "layers_to_transform", layers, "a layer index or a list of them", fix)
    if pc["peft_type"] != "LORA":
        raise UserError(f"{folder} is a {pc.get('peft_type')} adapter; only LoRA adapters (peft_type LORA) can be "
                        "loaded")
    if pc.get("lora_bias") or pc.get("bias", "none") not in ("none", None):
        raise UserError(f"{folder} trains biases (bias={pc.get('bias')!r}, lora_bias={pc.get('lora_bias')}); "
                        "only adapters with bias='none' can be loaded")
    if pc.get("modules_to_save"):
        raise UserError(f"{folder} also saves full modules ({pc['modules_to_save']}); only LoRA layers can be loaded: "
                        "make the adapter without modules_to_save")
    return pc


def _read_peft_weights(folder: Path) -> tuple[dict[str, torch.Tensor], dict]:
    st, binf = folder / PEFT_WEIGHTS, folder / PEFT_WEIGHTS_BIN
    if st.is_file():
        safetensors_header(st, fix="save the adapter again")  # sizes, dtypes and offsets checked before safetensors
        try:
            with safe_open(str(st), framework="pt", device="cpu") as f:
                return {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}
        except Exception as e:
            raise UserError(f"{st} is not a readable safetensors file ({type(e).__name__}); save the adapter again")
    if binf.is_file():
        sd = load_torch(binf, "PEFT adapter weights", "save the adapter again")
        if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
            raise UserError(f"{binf} holds {type(sd).__name__} instead of named tensors; save the adapter again")
        return dict(sd), {}
    raise UserError(f"{folder} has no {PEFT_WEIGHTS} or {PEFT_WEIGHTS_BIN}; copy the adapter weights next to "
                    f"{PEFT_CONFIG}")


def _pattern_get(pattern: dict, mod: str, default: Any) -> Any:
    # As PEFT matches rank_pattern/alpha_pattern keys: the key is a regex that must match the end of the name
    for key, value in (pattern or {}).items():
        if re.match(rf"(.*\.)?({key})$", mod):
            return value
    return default


def _scaling(pc: dict, mod: str, r: int, where: str) -> float:
    r_cfg = _pattern_get(pc.get("rank_pattern"), mod, pc.get("r", r))
    if int(r_cfg) != r:
        raise UserError(f"{where}: {mod} has rank {r} in the weights but {r_cfg} in {PEFT_CONFIG}; the adapter files "
                        "do not belong together: save the adapter again")
    alpha = float(_pattern_get(pc.get("alpha_pattern"), mod, pc.get("lora_alpha", 8)))
    return alpha / math.sqrt(r) if pc.get("use_rslora") else alpha / r


def _check_uniform(rs: list[tuple[int, float]], where: str, module: Optional[str]) -> tuple[int, float]:
    r0, s0 = rs[0]
    for r, s in rs[1:]:
        if r != r0 or not math.isclose(s, s0, rel_tol=1e-9):
            at = f" in {module}" if module else ""
            raise UserError(f"{where} uses different ranks or alpha/r scalings{at} (r={r0} and r={r}, scaling {s0:g} "
                            f"and {s:g}) "
                            "after mapping to lit-qlora's layers, which use one r and one alpha; make the adapter with "
                            "one r "
                            "and lora_alpha (no rank_pattern/alpha_pattern)")
    return r0, s0


def _expected_modules(pc: dict, universe: dict) -> list[str]:
    """HF modules that adapter_config.json's target_modules (and layers_to_transform) name."""
    tm = pc.get("target_modules")
    if not tm:
        return []
    layers = pc.get("layers_to_transform")
    if isinstance(layers, int):
        layers = [layers]
    out = []
    for mod, (_, cat, i) in universe.items():
        if isinstance(tm, str):
            hit = (cat != "head") if tm == "all-linear" else re.fullmatch(tm, mod) is not None
        else:
            hit = any(mod == t or mod.endswith("." + t) for t in tm)
        if cat == "head" and len([m for m, e in universe.items() if e[1] == "head"]) > 1:
            # GPT-NeoX's head is embed_out or lm_head depending on the transformers version: either may be unmatched
            continue
        if hit and (layers is None or i is None or i in layers):
            out.append(mod)
    return out


def _lit_meta(meta: dict, where: str) -> Optional[dict]:
    """Our LoRAConfig as our export recorded it in the weights' safetensors metadata; None for another tool's file.
    A record that is there but damaged (a lit_qlora_ key we never write, text that is no JSON object) is refused:
    read past, the import would silently lose what only it records (the exact alpha, LoRA+, a fused layer's split)."""
    # a key of ours with a flipped byte: anything but ours that names lit / qlora, or differs from ours in one place
    stray = [k for k in meta if k != _META_KEY and ("qlora" in k.lower() or k.lower().startswith("lit") or (
        len(k) == len(_META_KEY) and sum(a != b for a, b in zip(k, _META_KEY)) == 1))]
    if stray:
        raise UserError(f"{where}: its weights' metadata has the key {stray[0]!r}, which lit-qlora never writes (it "
                        f"writes {_META_KEY!r}): the file is damaged; export the adapter again")
    if _META_KEY not in meta:
        return None
    try:
        lit = json.loads(meta[_META_KEY])
    except (json.JSONDecodeError, TypeError):
        lit = None
    if not isinstance(lit, dict):
        raise UserError(f"{where}: its weights' {_META_KEY} metadata is not a JSON object: the file is damaged; export "
                        "the adapter again")
    return lit


def _gate_up_halves(lit: Optional[dict], A: torch.Tensor, B: torch.Tensor):
    """Undo our own export of fc_1's and fc_2's LoRAs as one on a fused gate_up (block-diagonal B, rank 2r), if it is
    one: ((A_1, B_1), (A_2, B_2)) or None."""
    r = int((lit or {}).get("r", 0))
    rows = B.shape[0] // 2
    if r <= 0 or A.shape[0] != 2 * r or B[:rows, r:].count_nonzero().item() or B[rows:, :r].count_nonzero().item():
        return None
    return (A[:r], B[:rows, :r]), (A[r:], B[rows:, r:])


def _block_diagonal(config: Config, lit: Optional[dict], A: torch.Tensor, B: torch.Tensor):
    """Undo our own export of a fused qkv LoRA (block-diagonal B, rank n*r), if it is one: (A, B, r, flags) or None."""
    if lit is None:
        return None
    enabled = [c for c in _QKV if lit.get(c)]
    r = int(lit.get("r", 0))
    if not enabled or r <= 0 or A.shape[0] != len(enabled) * r:
        return None
    q, k, v = config.qkv_sizes
    rows = {"query": (0, q), "key": (q, k), "value": (q + k, v)}
    mask = torch.zeros_like(B, dtype=torch.bool)
    pieces = []
    for j, c in enumerate(enabled):
        start, n = rows[c]
        mask[start:start + n, j * r:(j + 1) * r] = True
        pieces.append(B[start:start + n, j * r:(j + 1) * r])
    if B[~mask].count_nonzero().item():
        return None  # trained further as one shared LoRA: not block-diagonal any more
    return A, torch.cat(pieces), r, {c: c in enabled for c in _QKV}
