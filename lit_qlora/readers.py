"""Every file the project reads goes through one of these readers, which turn each way the file can be wrong into one
`UserError` naming the file and, where it can, the field, tensor or line.

- `read_text`: the file is there, is a regular file (not a folder, not a symlink loop) and is UTF-8 text;
- `read_json` / `read_jsonl` / `read_yaml`: the text parses, and its top level is of the expected kind; `check_fields`
  checks named fields against a tiny schema (type, finite, positive, bounded);
- `read_csv_rows`: the rows of a CSV file, whatever the size of a field;
- `safetensors_header`: a safetensors header checked against the file before any tensor is read (a bounded size,
  known dtypes, shape x dtype = byte span, spans inside the file and not overlapping);
- `load_torch`: a torch file read with `weights_only=True` (no code runs from a damaged or foreign pickle).

Each takes `fix`, the second half of the message ("what is wrong; how to fix it").
"""
from __future__ import annotations

import csv
import errno
import io
import json
import math
import os
from pathlib import Path
from typing import Any, Iterable, Optional

from lit_qlora.families import SPECS, architecture_of, spec, text_part
from lit_qlora.utils import UserError

# the largest size any one model dimension may have (a vocabulary, a layer width, a context length): larger ones are
# not models but damaged numbers, and their products would overflow
MAX_SIZE = 2**31 - 1
MAX_EPS = 0.01  # the largest norm epsilon a config may give
# safetensors' own bound on a header (100 MB); a larger one is refused before it is read
MAX_SAFETENSORS_HEADER = 100_000_000
# bytes per element of every dtype the safetensors format names
SAFETENSORS_DTYPE_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8,
                           "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


MAX_NAME, MAX_PATH = 255, 4096  # bytes: the longest file name and path Linux (and most file systems) look up


def check_path(path: Any, what: str) -> None:
    """That a path a flag or a file names can be looked up at all (None passes): no NUL byte, no name longer than 255
    bytes, no more than 4096 in all. Otherwise a UserError naming `what` (a damaged --config file can hold megabytes
    where a folder belongs; the file system would answer with an error that is no user's message)."""
    if path is None:
        return
    text = str(path)
    try:
        raw = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        raw = b"\0"  # not even bytes: as unusable as a NUL
    shown = repr(text if len(text) <= 60 else text[:57] + "...")
    if b"\0" in raw:
        raise UserError(f"{what} {shown} is not a usable path (it holds a NUL byte or unencodable text); fix the path")
    longest = max(len(part) for part in raw.split(b"/"))
    if len(raw) > MAX_PATH or longest > MAX_NAME:
        raise UserError(f"{what} {shown} is not a usable path ({len(raw)} bytes, its longest name {longest}; file "
                        f"systems allow {MAX_NAME} per name and {MAX_PATH} in all); fix the path")


def check_file(path: Path, what: str = "file", fix: str = "check the path") -> Path:
    """`path` as a Path, once it is known to be a regular file (a missing file, a folder or a symlink loop in its
    place is a UserError)."""
    path = Path(path)
    try:
        st = path.stat()
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UserError(f"{what} {path} is a symlink loop; replace it with the real file") from None
        if e.errno == errno.ENOENT:
            raise UserError(f"{what} {path} does not exist; {fix}") from None
        raise UserError(f"cannot read {what} {path} ({e.strerror}); {fix}") from None
    if not os.path.isfile(path):
        kind = "a folder" if os.path.isdir(path) else "not a regular file"
        raise UserError(f"{what} {path} is {kind}; {fix}")
    del st
    return path


def read_bytes(path: Path, what: str = "file", fix: str = "check the path") -> bytes:
    path = check_file(path, what, fix)
    try:
        return path.read_bytes()
    except OSError as e:
        raise UserError(f"cannot read {what} {path} ({e.strerror}); {fix}") from None


def decode_text(data: bytes, where: str, fix: str) -> str:
    """UTF-8 text (a byte-order mark dropped); invalid bytes are a UserError naming their offset."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise UserError(f"{where} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); {fix}") from None


def read_text(path: Path, what: str = "file", fix: str = "fix or re-copy the file") -> str:
    path = Path(path)
    return decode_text(read_bytes(path, what, fix), f"{what} {path}" if what != "file" else str(path), fix)


def _kind(value: Any) -> str:
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    if value is None:
        return "null"
    return f"a {type(value).__name__} ({_short(value)})"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def parse_json(text: str, where: str, fix: str, expect: Optional[type] = None) -> Any:
    """`text` parsed as JSON; syntax errors name the line and column, and `expect` (dict or list) the top level."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{where} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); {fix}") from None
    except RecursionError:
        raise UserError(f"{where} is not usable JSON (nested too deeply); {fix}") from None
    if expect is not None and not isinstance(data, expect):
        want = "an object" if expect is dict else "a list"
        raise UserError(f"{where} holds {_kind(data)} where {want} belongs; {fix}")
    return data


def read_json(path: Path, expect: Optional[type] = dict, what: str = "file",
              fix: str = "fix or re-copy the file") -> Any:
    """The JSON in `path`, its top level of type `expect` (dict, list, or None for any)."""
    path = Path(path)
    where = f"{what} {path}" if what != "file" else str(path)
    return parse_json(read_text(path, what, fix), where, fix, expect)


def read_yaml(path: Path, what: str = "file", fix: str = "fix the file") -> Any:
    """The YAML in `path` (a .json file's JSON); syntax errors name the line and column."""
    import yaml

    path = Path(path)
    where = f"{what} {path}" if what != "file" else str(path)
    text = read_text(path, what, fix)
    if path.suffix.lower() == ".json":  # as JSON: YAML would read a JSON NaN or Infinity as the text "NaN"
        return parse_json(text, where, fix)
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or type(e).__name__
        raise UserError(f"{where} is not valid YAML ({problem}{at}); {fix}") from None
    except RecursionError:
        raise UserError(f"{where} is not usable YAML (nested too deeply); {fix}") from None


def read_csv_rows(path: Path, what: str = "file", fix: str = "fix or remove the file") -> list[dict]:
    """The rows of a CSV file with a header line, as dicts (a row with more fields than the header keeps the rest
    under None, as csv.DictReader does); fields of any size; undecodable bytes or a broken quote name the line."""
    path = Path(path)
    where = f"{what} {path}" if what != "file" else str(path)
    return parse_csv(read_text(path, what, fix), where, fix)


def parse_csv(text: str, where: str, fix: str) -> list[dict]:
    """`read_csv_rows` of text already read."""
    try:
        reader = csv.DictReader(io.StringIO(text, newline=""))
        old = csv.field_size_limit()
        csv.field_size_limit(max(old, len(text) + 1))
        try:
            return list(reader)
        finally:
            csv.field_size_limit(old)
    except csv.Error as e:
        raise UserError(f"{where} is not valid CSV (line {reader.line_num}: {e}); {fix}") from None


# ---- checking fields -----------------------------------------------------------------------------------------------
# kinds: "size" an int in 1..MAX_SIZE | "count" an int in 0..MAX_SIZE | "number" a finite number | "positive" a finite
# number > 0 | "fraction" a finite number in [0, 1] | "str" | "bool" | "object" | "list" | "ids" null, an int >= 0 or a
# list of them | "str_or_object" a string or an object with a string "content" (a special token of
# tokenizer_config.json, as text or as an AddedToken: transformers refuses anything else)
_EXPECTED = {"size": f"an integer from 1 to {MAX_SIZE}", "count": f"an integer from 0 to {MAX_SIZE}",
             "number": "a finite number", "positive": "a finite number > 0",
             "eps": f"a number in (0, {MAX_EPS:g}] (models use 1e-5 or 1e-6)", "fraction": "a number from 0 to 1",
             "str": "a string", "bool": "true or false", "object": "an object", "list": "a list",
             "ids": "a token id, a list of them or null",
             "str_or_object": 'a string or an object with a string "content"',
             "template": "a string or a list of objects", "int": "an integer", "float": "a number"}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _fits(kind: str, v: Any) -> bool:
    if kind == "size":
        return _is_int(v) and 1 <= v <= MAX_SIZE
    if kind == "count":
        return _is_int(v) and 0 <= v <= MAX_SIZE
    if kind == "number":
        return _is_number(v)
    if kind == "positive":
        return _is_number(v) and v > 0
    if kind == "eps":  # a norm's epsilon: models use 1e-5 or 1e-6 (BERT 1e-12); 2.5 would rescale every activation
        return _is_number(v) and 0 < v <= MAX_EPS
    if kind == "fraction":
        return _is_number(v) and 0 <= v <= 1
    if kind == "str":
        return isinstance(v, str)
    if kind == "bool":
        return isinstance(v, bool)
    if kind == "object":
        return isinstance(v, dict)
    if kind == "list":
        return isinstance(v, list)
    if kind == "ids":
        return v is None or (_is_int(v) and 0 <= v <= MAX_SIZE) or (
            isinstance(v, list) and all(_is_int(x) and 0 <= x <= MAX_SIZE for x in v))
    if kind == "str_or_object":
        return isinstance(v, str) or isinstance(v, dict) and isinstance(v.get("content"), str)
    if kind == "int":
        return _is_int(v)
    if kind == "float":  # any number, NaN and inf included (a diverged run's loss)
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if kind == "template":
        return isinstance(v, str) or (isinstance(v, list) and all(isinstance(t, dict) for t in v))
    raise ValueError(f"unknown field kind {kind!r}")


def check_fields(data: dict, where: object, fields: dict[str, str], required: Iterable[str] = (),
                 fix: str = "fix the file", nullable: bool = True) -> dict:
    """Check `data`'s `fields` ({name: kind}, see above) where present (a null counts as absent when `nullable`),
    and that every name in `required` is there. Returns `data`."""
    if not isinstance(data, dict):
        raise UserError(f"{where} holds {_kind(data)} where an object belongs; {fix}")
    for name in required:
        if data.get(name) is None:
            raise UserError(f"{where} has no {name!r}; {fix}")
    for name, kind in fields.items():
        if name not in data or (nullable and data[name] is None):
            continue
        if not _fits(kind, data[name]):
            raise UserError(f"{where}: {name} is {_short(data[name])}, expected {_EXPECTED[kind]}; {fix}")
    return data


def check_value(ok: bool, where: object, name: str, value: Any, expected: str, fix: str) -> None:
    if not ok:
        raise UserError(f"{where}: {name} is {_short(value)}, expected {expected}; {fix}")


# ---- safetensors ---------------------------------------------------------------------------------------------------
def safetensors_header(path: Path, fix: str = "convert the checkpoint again (delete it and rerun)",
                       dtypes: Optional[Iterable[str]] = None) -> tuple[dict, dict, int]:
    """(tensor entries, `__metadata__` ({} without), byte offset of the tensor data) of a safetensors file, every
    entry checked: a known dtype (one of `dtypes` when given), a shape of non-negative ints, data offsets whose span
    is the shape's byte size, inside the file, and no two spans overlapping. Anything else is a UserError that says
    "damaged or truncated" and names the tensor."""
    path = check_file(path, "weights file", fix)

    def bad(detail: str) -> UserError:
        return UserError(f"{path} is damaged or truncated ({detail}); {fix}")

    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise bad(f"{size} bytes, too short for a header")
        n = int.from_bytes(head, "little")
        if n < 2 or n > MAX_SAFETENSORS_HEADER or 8 + n > size:
            raise bad(f"a header of {n} bytes in a file of {size}")
        raw = f.read(n)
    if len(raw) != n:
        raise bad("the header is cut short")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad(f"the header is not UTF-8 at byte {e.start}") from None
    try:
        header = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise bad(f"the header is not JSON: {getattr(e, 'msg', 'nested too deeply')}") from None
    if not isinstance(header, dict):
        raise bad(f"the header holds {_kind(header)}, not an object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise bad("__metadata__ is not an object of strings")
    known = set(SAFETENSORS_DTYPE_SIZES if dtypes is None else dtypes)
    base, spans = 8 + n, []
    for name, e in header.items():
        if not isinstance(e, dict):
            raise bad(f"the entry of tensor {name!r} is {_kind(e)}")
        dtype, shape, offsets = e.get("dtype"), e.get("shape"), e.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in known:
            raise bad(f"tensor {name!r} has dtype {_short(dtype)}, expected one of {', '.join(sorted(known))}")
        if not (isinstance(shape, list) and all(_is_int(d) and 0 <= d <= 2**62 for d in shape)):
            raise bad(f"tensor {name!r} has shape {_short(shape)}, expected a list of sizes")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) and o >= 0 for o in offsets)
                and offsets[0] <= offsets[1]):
            raise bad(f"tensor {name!r} has data_offsets {_short(offsets)}, expected [begin, end]")
        nbytes = math.prod(shape) * SAFETENSORS_DTYPE_SIZES[dtype]
        if nbytes != offsets[1] - offsets[0]:
            raise bad(f"tensor {name!r}: shape {shape} of {dtype} is {nbytes} bytes but its data_offsets span "
                      f"{offsets[1] - offsets[0]}")
        if base + offsets[1] > size:
            raise bad(f"truncated: tensor {name!r} ends at byte {base + offsets[1]} of a {size}-byte file")
        spans.append((offsets[0], offsets[1], name))
    spans.sort()
    for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
        if b1 < e0 and b1 < e1 and b0 < e0:  # empty tensors overlap nothing
            raise bad(f"tensors {n0!r} and {n1!r} overlap in the file")
    # The format's own rule, which safetensors enforces: the tensors tile the data from its first byte to the last.
    end = 0
    for b0, e0, name in spans:
        if b0 != end:
            raise bad(f"tensor {name!r} starts at data byte {b0}, where the previous one ended at {end}")
        end = e0
    if base + end != size:
        raise bad(f"{size - base - end} bytes after the last tensor" if base + end < size else "the data is cut short")
    return header, meta, base


# ---- torch files ---------------------------------------------------------------------------------------------------
def torch_zip_damage(path: Path) -> Optional[str]:
    """The first entry of a torch file (a zip archive since torch 1.6) whose bytes fail the CRC-32 the archive stores
    for them, else None. torch.load never checks these sums: a flipped bit in a tensor's bytes loads as another
    number. A file the zipfile module cannot open is left to torch.load, which says what is wrong with it."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as z:
            return z.testzip()
    except Exception:  # noqa: BLE001 - not a zip zipfile can read: torch.load's error is the one to show
        return None


def load_torch_checked(path: Path, mmap: bool = False) -> Any:
    """torch.load on CPU, `weights_only=True`, after the archive's CRC-32 sums are checked (a mismatch is a
    ValueError naming the entry); every other failure is torch.load's own exception."""
    import torch

    bad = torch_zip_damage(path)
    if bad is not None:
        raise ValueError(f"its entry {bad} fails the CRC-32 check stored for it (bytes changed on disk)")
    return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)


def load_torch(path: Path, what: str = "checkpoint", fix: str = "use an earlier checkpoint", mmap: bool = False) -> Any:
    """A torch file loaded on CPU with `weights_only=True`, its CRC-32 sums checked. Any failure to unpickle it is
    the file's: damaged, cut short, or not a torch file."""
    path = check_file(path, what, fix)
    try:
        return load_torch_checked(path, mmap=mmap)
    except Exception as e:  # a torn zip, a foreign pickle, random bytes: all the file's fault
        detail = str(e).strip().splitlines()[0][:120] if str(e).strip() else ""
        raise UserError(f"{what} {path} is not readable ({type(e).__name__}{': ' + detail if detail else ''}); "
                        f"it may be damaged: {fix}") from None


# ---- the model config's values -------------------------------------------------------------------------------------
_CONFIG_SIZES = ("block_size", "vocab_size", "n_layer", "n_head", "n_embd")
_CONFIG_OPTIONAL_SIZES = ("n_query_groups", "head_size", "intermediate_size", "sliding_window_size",
                          "moe_intermediate_size")
_CONFIG_COUNTS = ("moe_n_expert", "moe_top_k")
_CONFIG_OPTIONAL_POSITIVE = ("rope_local_base", "attention_scale", "attn_softcap", "final_softcap", "moe_swiglu_limit",
                             "moe_swiglu_alpha")
_CONFIG_BOOLS = ("parallel_residual", "shared_attention_norm", "norm_unit_offset", "bias", "attn_bias", "lm_head_bias",
                 "tie_embeddings", "scale_embeddings", "pre_norms", "post_norms", "norm_fp32_scale", "moe_norm_topk",
                 "moe_bias", "moe_mxfp4", "attn_sinks")
_CONFIG_CHOICES = {"norm_class": ("RMSNorm", "LayerNorm"), "mlp_class": ("GptNeoxMLP", "LLaMAMLP"),
                   "activation": ("silu", "gelu", "gelu_tanh"), "qk_norm": (None, "head", "full")}
_LAYER_TYPES = ("sliding_attention", "full_attention")


def check_config_values(cfg: Any, where: str = "the model config") -> None:
    """Refuse a `Config` whose values no model has (run by `Config.__post_init__` before anything is derived from
    them): sizes that are not positive integers, heads that do not divide the width or the query groups, a rotary
    share outside (0, 1], non-finite or non-positive eps / rope base, unknown norm / MLP / activation names."""
    fix = "fix the model config (or convert the checkpoint again)"
    for name in _CONFIG_SIZES:
        v = getattr(cfg, name)
        check_value(_fits("size", v), where, name, v, _EXPECTED["size"], fix)
    for name in _CONFIG_OPTIONAL_SIZES:
        v = getattr(cfg, name)
        check_value(v is None or _fits("size", v), where, name, v, _EXPECTED["size"] + " or null", fix)
    for name in _CONFIG_BOOLS:
        v = getattr(cfg, name)
        check_value(isinstance(v, bool), where, name, v, "true or false", fix)
    for name, choices in _CONFIG_CHOICES.items():
        v = getattr(cfg, name)
        check_value(v in choices, where, name, v, "one of " + ", ".join(map(json.dumps, choices)), fix)
    for name in _CONFIG_COUNTS:
        v = getattr(cfg, name)
        check_value(_fits("count", v), where, name, v, _EXPECTED["count"], fix)
    check_value(_fits("positive", cfg.rope_base), where, "rope_base", cfg.rope_base, _EXPECTED["positive"], fix)
    check_value(_fits("eps", cfg.norm_eps), where, "norm_eps", cfg.norm_eps, _EXPECTED["eps"], fix)
    for name in _CONFIG_OPTIONAL_POSITIVE:
        v = getattr(cfg, name)
        check_value(v is None or _fits("positive", v), where, name, v, _EXPECTED["positive"] + " or null", fix)
    n = cfg.n_layer
    v = cfg.layer_types
    check_value(v is None or isinstance(v, list) and len(v) == n and all(t in _LAYER_TYPES for t in v), where,
                "layer_types", v, f"null or a list of {n} entries, each one of " + ", ".join(_LAYER_TYPES), fix)
    for name in ("nope_layers", "moe_dense_layers"):
        v = getattr(cfg, name)
        check_value(v is None or isinstance(v, list) and all(_is_int(i) and 0 <= i < n for i in v), where, name, v,
                    f"null or a list of layer numbers from 0 to {n - 1}", fix)
    v = cfg.rotary_percentage
    check_value(_is_number(v) and 0 < v <= 1, where, "rotary_percentage", v, "a number in (0, 1]", fix)
    check_value(isinstance(cfg.name, str), where, "name", cfg.name, "a string", fix)
    arch = cfg.hf_architecture
    check_value(isinstance(arch, str) and arch in SPECS, where, "hf_architecture", arch,
                "an architecture this package implements (" + ", ".join(sorted(SPECS)[:3]) + ", ...)", fix)
    check_value(cfg.rope_scaling is None or isinstance(cfg.rope_scaling, dict), where, "rope_scaling",
                cfg.rope_scaling, "an object or null", fix)
    if isinstance(cfg.rope_scaling, dict):
        check_fields(cfg.rope_scaling, f"{where} rope_scaling",
                     {"factor": "positive", "low_freq_factor": "positive", "high_freq_factor": "positive",
                      "original_max_position_embeddings": "size", "rope_type": "str"}, fix=fix)
    check_value(isinstance(cfg.hf_extra, dict), where, "hf_extra", cfg.hf_extra, "an object", fix)
    if cfg.head_size is None and cfg.n_embd % cfg.n_head:
        raise UserError(f"{where}: n_embd={cfg.n_embd} is not a multiple of n_head={cfg.n_head} (and no head_size is "
                        f"given); {fix}")
    if cfg.n_query_groups is not None and cfg.n_query_groups > cfg.n_head:
        raise UserError(f"{where}: n_query_groups={cfg.n_query_groups} is more than n_head={cfg.n_head}; {fix}")
    head = cfg.head_size if cfg.head_size is not None else cfg.n_embd // cfg.n_head
    rope = int(cfg.rotary_percentage * head)
    if rope < 2 or rope % 2:
        raise UserError(f"{where}: rotary_percentage={cfg.rotary_percentage} of head_size={head} rotates {rope} "
                        f"elements, expected an even number of at least 2; {fix}")


# ---- Hugging Face config.json ----------------------------------------------------------------------------------------
HF_CONFIG_FIELDS = {
    "architectures": "list", "model_type": "str", "_name_or_path": "str",
    "vocab_size": "size", "num_hidden_layers": "size", "num_attention_heads": "size", "hidden_size": "size",
    "intermediate_size": "size", "num_key_value_heads": "size", "head_dim": "size", "max_position_embeddings": "size",
    "ffn_hidden_size": "size", "num_kv_heads": "size", "sliding_window": "size", "num_ln_in_parallel_attn": "size",
    "rope_theta": "positive", "rms_norm_eps": "eps", "layer_norm_eps": "eps",
    "layer_norm_epsilon": "eps", "partial_rotary_factor": "fraction", "rotary_pct": "fraction",
    "rope_scaling": "object", "rope_parameters": "object", "hidden_act": "str", "hidden_activation": "str",
    "activation": "str", "tie_word_embeddings": "bool", "use_parallel_residual": "bool", "bias": "bool",
    "attention_bias": "bool", "mlp_bias": "bool", "use_sliding_window": "bool", "new_decoder_architecture": "bool",
    "multi_query": "bool", "parallel_attn": "bool", "alibi": "bool", "qk_layernorm": "bool", "use_qkv_bias": "bool",
    "num_local_experts": "size", "num_experts_per_tok": "size", "swiglu_limit": "positive", "swiglu_alpha": "positive",
    "quantization_config": "object", "attention_dropout": "fraction", "output_router_logits": "bool",
}


def read_hf_config(path: "Path | dict") -> dict:
    """A transformers `config.json` (a path, or its dict), checked where `Config.from_hf_config` reads it: an object,
    the sizes every supported architecture needs (positive integers), the types of the settings it maps, and heads that
    divide: a UserError naming the file and the field otherwise."""
    where = "config.json" if isinstance(path, dict) else str(path)
    fix = "fix or re-download config.json"
    hf = dict(path) if isinstance(path, dict) else read_json(path, dict, fix=fix)
    archs = hf.get("architectures")
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise UserError(f"{where}: architectures is {_short(archs)}, expected a list of names; {fix}")
    try:
        hf = text_part(hf)  # a multimodal model: its language model's config (Gemma 3 4B-27B)
        archs = hf.get("architectures")
        spec(architecture_of(hf))  # an architecture we do not implement is named before any field it may lack
    except UserError as e:
        raise UserError(f"{where}: {e}") from None
    falcon = (archs[0] if archs else hf.get("model_type")) in ("FalconForCausalLM", "falcon")
    required = ["vocab_size", "num_hidden_layers", "num_attention_heads", "hidden_size"]
    if not falcon:  # (the first Falcon configs have neither: 4x the width and 2048 positions)
        # every config transformers saves has the context length: a default would differ from transformers' own by
        # architecture (Llama 2048, Mistral 32768, Qwen2 32768)
        required += ["intermediate_size", "max_position_embeddings"]
    check_fields(hf, where, HF_CONFIG_FIELDS, required, fix)
    for name in ("rope_scaling", "rope_parameters"):
        rp = hf.get(name)
        if isinstance(rp, dict):
            check_fields(rp, f"{where} {name}", {"rope_theta": "positive", "partial_rotary_factor": "fraction",
                                                  "factor": "positive", "low_freq_factor": "positive",
                                                  "high_freq_factor": "positive",
                                                  "original_max_position_embeddings": "size", "rope_type": "str",
                                                  "type": "str"}, fix=fix)
    heads, width = hf["num_attention_heads"], hf["hidden_size"]
    kv = hf.get("num_key_value_heads") or hf.get("num_kv_heads") or heads
    if heads % kv:
        raise UserError(f"{where}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}; {fix}")
    if not hf.get("head_dim") and width % heads:
        raise UserError(f"{where}: hidden_size={width} is not a multiple of num_attention_heads={heads} (and there is "
                        f"no head_dim); {fix}")
    return hf

# what every model_config.json / adapter model_config holds (written from asdict(Config)): a missing one would be
# silently replaced by a default of another model. The fields of the Config that every version has written; fields
# added later may be absent from older files (their defaults are what those files meant)
REQUIRED_CONFIG_KEYS = ("name", "hf_architecture", "block_size", "vocab_size", "n_layer", "n_head", "n_embd",
                        "n_query_groups", "head_size", "rotary_percentage", "rope_base", "rope_scaling",
                        "parallel_residual", "shared_attention_norm", "norm_class", "norm_eps", "norm_unit_offset",
                        "bias", "attn_bias", "lm_head_bias", "mlp_class", "activation", "intermediate_size",
                        "tie_embeddings", "scale_embeddings", "sliding_window_size", "hf_extra")


def check_config_dict(data: Any, where: object, fix: str) -> dict:
    """A stored model config (model_config.json, an adapter's model_config): an object holding every field of
    REQUIRED_CONFIG_KEYS (null where null is a value, e.g. rope_scaling). Returns it."""
    if not isinstance(data, dict):
        raise UserError(f"{where} holds {_kind(data)} where an object belongs; {fix}")
    missing = [k for k in REQUIRED_CONFIG_KEYS if k not in data]
    if missing:
        raise UserError(f"{where} has no {missing[0]!r}" + (f" ({len(missing)} fields missing)" if len(missing) > 1
                                                             else "") + f"; {fix}")
    return data


# ---- the tokenizer's side files (each optional) ----------------------------------------------------------------------
TOKENIZER_CONFIG_FIELDS = {"bos_token": "str_or_object", "eos_token": "str_or_object", "pad_token": "str_or_object",
                           "unk_token": "str_or_object", "sep_token": "str_or_object", "cls_token": "str_or_object",
                           "mask_token": "str_or_object", "add_bos_token": "bool", "add_eos_token": "bool",
                           "chat_template": "template", "added_tokens_decoder": "object", "model_max_length": "number"}
GENERATION_CONFIG_FIELDS = {"bos_token_id": "ids", "eos_token_id": "ids", "pad_token_id": "ids"}
TOKEN_ID_FIELDS = {"bos_token_id": "ids", "eos_token_id": "ids", "pad_token_id": "ids"}  # what config.json adds


def read_side_json(path: Path, fields: dict[str, str], fix: str = "fix or re-copy the file") -> dict:
    """An optional JSON object file ({} when there is none) with `fields` checked (see `check_fields`)."""
    path = Path(path)
    if not os.path.lexists(path):
        return {}
    return check_fields(read_json(path, dict, fix=fix), path, fields, fix=fix)
