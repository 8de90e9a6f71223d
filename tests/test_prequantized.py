"""scripts/quantize_checkpoint.py and the loader reading what it stores (lit_qlora/quant/prequantized.py).

1. A load that reads the stored file never runs a quantizer, and every layer is bitsandbytes' own quantization of the
   checkpoint's weight (the reference layers of tests/test_quantize.py), for every mode at bf16 and fp32, the tied
   4-bit head included in both of its loading paths, on every family, and with 4-bit blocks straddling rows;
   bitsandbytes' own `Params4bit.from_prequantized` reads the file.
2. A file that no longer matches (the checkpoint rewritten, another bitsandbytes, a damaged file) is ignored with one
   line, and the layers are quantized from the new weights.
3. Layers an adapter changes while it merges are quantized from the merged weights, the others read; a LoRA
   (training) load reads them too.
4. generate/base.py reads it (its "Loaded" line says so) and prints the same text as without it.
5. Bad input: one line, exit 2.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import (
    adapter_of,
    assert_same_stored,
    converted_tiny,
    lora_cfg,
    random_tokens,
    randomize_lora,
    reference_layer,
    run_script_here,
)
from safetensors.torch import load_file

from lit_qlora.checkpoint import LIT_WEIGHTS, read_safetensors, safetensors_specs, write_safetensors_stream
from lit_qlora.loader import load_model
from lit_qlora.lora import LoRALinear
from lit_qlora.precision import parse_precision
from lit_qlora.quant.prequantized import load_note, stored_path
from lit_qlora.quant.quant_mode import QuantMode
from lit_qlora.quant.quantize import is_quantized, quantized_parts, quiet_bnb_import

quiet_bnb_import()
import bitsandbytes as bnb  # noqa: E402


def copy_of(folder: Path, tmp_path: Path) -> Path:
    """A private copy of a shared checkpoint folder (the stored file is written next to its weights)."""
    return Path(shutil.copytree(folder, tmp_path / folder.name))


def quantize_checkpoint(folder: Path, mode: str, precision: str) -> Path:
    code = run_script_here("quantize_checkpoint.py", "--checkpoint_dir", folder, "--quantize", mode,
                           "--precision", precision)
    assert code == 0
    path = stored_path(folder / LIT_WEIGHTS, mode, parse_precision(precision).dtype)
    assert path.is_file()
    return path


def forbid_quantizing(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("a quantizer ran")

    for name in ("quantize_4bit", "quantize_blockwise", "int8_vectorwise_quant"):
        monkeypatch.setattr(bnb.functional, name, refuse)


def quantized_layers(model) -> dict[str, torch.nn.Module]:
    return {n.removesuffix(".base"): m for n, m in model.named_modules() if is_quantized(m)}


def checkpoint_weight(folder: Path, key: str, tied: bool) -> torch.Tensor:
    key = "transformer.wte.weight" if tied and key == "lm_head.weight" else key
    stack, _, expert = key.removesuffix(".weight").rpartition(".layers.")  # one expert of a stacked [E, out, in]
    if stack.endswith((".experts.fc_1", ".experts.fc_2", ".experts.proj")):
        return next(t for _, t in read_safetensors(folder / LIT_WEIGHTS, {stack + ".weight"}))[int(expert)]
    return next(t for _, t in read_safetensors(folder / LIT_WEIGHTS, {key}))


# ---- 1. the stored layers are bitsandbytes' own quantization ---------------------------------------------------
@pytest.mark.parametrize("precision", ["bf16-true", "32-true"])
@pytest.mark.parametrize("mode", QuantMode.names())
def test_loads_read_bitsandbytes_own_quantization_from_the_stored_file(lora_tied, tmp_path, monkeypatch, mode,
                                                                       precision):
    folder = copy_of(lora_tied.folder, tmp_path)
    path = quantize_checkpoint(folder, mode, precision)
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # as readable as any new file, not private
    dtype = parse_precision(precision).dtype
    for generation in (False, True):  # the tied 4-bit head: filled after the embedding, or serving it
        forbid_quantizing(monkeypatch)
        model = load_model(folder, precision=precision, quantize=mode, quantize_lm_head=True,
                           embedding_from_head=generation)
        monkeypatch.undo()
        assert model.stored_quantization == path
        layers = quantized_layers(model)
        assert "lm_head" in layers and len(layers) == 1 + 5 * lora_tied.config.n_layer  # qkv, proj, fc_1, fc_2, proj
        for name, layer in layers.items():
            w = checkpoint_weight(folder, name + ".weight", tied=True).to(dtype)
            assert_same_stored(layer, reference_layer(mode, w, dtype, quantized_parts(model.config, name)))
    if precision == "bf16-true":  # the file is per compute dtype: bf16-mixed computes in bf16 too
        assert load_model(folder, precision="bf16-mixed", quantize=mode).stored_quantization == path
    if mode == "bnb.int8":
        return
    stored = load_file(path)  # the safetensors library's reader, and bitsandbytes' own loader of its serialization
    F = bnb.functional
    for name in ("lm_head", "transformer.h.1.mlp.fc_2"):
        key = name + ".weight"
        stats = {k[len(key) + 1:]: v for k, v in stored.items() if k.startswith(key + ".")}
        theirs = bnb.nn.Params4bit.from_prequantized(stored[key], stats, device="cpu")
        ref = reference_layer(mode, checkpoint_weight(folder, key, tied=True).to(dtype), dtype).weight
        assert torch.equal(F.dequantize_4bit(theirs.data, theirs.quant_state), F.dequantize_4bit(ref.data,
                                                                                                 ref.quant_state))


def test_every_family_reads_bitsandbytes_own_quantization(family_ckpt, tmp_path, monkeypatch):
    """Biases, fused or separate projections, GQA/MQA, tied or not: every quantized layer of every family, read
    from the stored file, is bitsandbytes' own quantization of the checkpoint's weight."""
    folder = copy_of(family_ckpt.folder, tmp_path)
    path = quantize_checkpoint(folder, "bnb.nf4-dq", "bf16-true")
    forbid_quantizing(monkeypatch)
    model = load_model(folder, precision="bf16-true", quantize="bnb.nf4-dq", quantize_lm_head=True,
                       embedding_from_head=True)
    monkeypatch.undo()
    assert model.stored_quantization == path
    tied = model.config.tie_embeddings
    for name, layer in quantized_layers(model).items():
        w = checkpoint_weight(folder, name + ".weight", tied).to(torch.bfloat16)
        ref = reference_layer("bnb.nf4-dq", w, torch.bfloat16, quantized_parts(model.config, name))
        assert_same_stored(layer, ref)


def test_blocks_straddling_rows_read_back_right(tmp_path_factory, monkeypatch):
    """in_features 96 (like Llama's 1376-wide MLPs): 4-bit blocks straddle rows, bitsandbytes' CPU path needs our flat
    dequantization; read from the file, the layers are bitsandbytes' own and generation decodes as before."""
    from lit_qlora.generation import generate
    from lit_qlora.inference import fast_cpu_4bit_decoding

    ckpt = converted_tiny(tmp_path_factory, "llama", "odd-llama", intermediate_size=96)
    folder, mode = ckpt.folder, "bnb.nf4"
    path = quantize_checkpoint(folder, mode, "32-true")
    forbid_quantizing(monkeypatch)
    model = load_model(folder, precision="32-true", quantize=mode, quantize_lm_head=True).eval()
    monkeypatch.undo()
    assert model.stored_quantization == path
    layer = quantized_layers(model)["transformer.h.0.mlp.proj"]
    assert layer.in_features == 96
    assert_same_stored(layer, reference_layer(mode, checkpoint_weight(folder, "transformer.h.0.mlp.proj.weight",
                                                                      False), torch.float32))
    fresh = load_model(folder, precision="32-true", quantize=mode, quantize_lm_head=True, use_stored=False).eval()
    prompt = random_tokens(5, seed=3)
    outs = []
    for m in (model, fresh):
        fast_cpu_4bit_decoding(m)
        outs.append(generate(m, prompt, max_new_tokens=12))
    assert torch.equal(outs[0], outs[1])


# ---- 2. a file that no longer matches is ignored, in one line ---------------------------------------------------
def rewrite_scaled(weights: Path, factor: float) -> None:
    """The checkpoint again with every tensor scaled (same names, shapes and dtypes: only the data differs)."""
    tensors = {k: t.clone() for k, t in read_safetensors(weights)}
    write_safetensors_stream(weights, safetensors_specs(weights), ((k, t * factor) for k, t in tensors.items()))


def test_a_stored_file_that_no_longer_matches_is_ignored_with_one_line(lora_llama, tmp_path, monkeypatch, capsys):
    folder = copy_of(lora_llama.folder, tmp_path)
    mode, precision, dtype = "bnb.nf4", "bf16-true", torch.bfloat16
    path = quantize_checkpoint(folder, mode, precision)
    capsys.readouterr()

    def load(expect: str):
        model = load_model(folder, precision=precision, quantize=mode)
        note = capsys.readouterr().err.strip().splitlines()
        assert model.stored_quantization is None
        assert len(note) == 1 and note[0].startswith("note: ") and expect in note[0], note
        return model

    rewrite_scaled(folder / LIT_WEIGHTS, 1.5)  # converted again, or another model of the same shape
    model = load("is not the file it was made from")
    for name, layer in quantized_layers(model).items():  # quantized from the new weights
        w = checkpoint_weight(folder, name + ".weight", False).to(dtype)
        assert_same_stored(layer, reference_layer(mode, w, dtype, quantized_parts(model.config, name)))

    path = quantize_checkpoint(folder, mode, precision)
    assert load_model(folder, precision=precision, quantize=mode).stored_quantization == path
    capsys.readouterr()
    monkeypatch.setattr(bnb, "__version__", "0.0.1")
    load("written by bitsandbytes")
    monkeypatch.undo()

    path.write_bytes(path.read_bytes()[:5])  # damaged
    load("damaged")
    capsys.readouterr()
    # another compute dtype has its own file: none here, and nothing to say
    assert load_model(folder, precision="32-true", quantize=mode).stored_quantization is None
    assert capsys.readouterr().err == ""


# ---- 3. merged adapters and LoRA loads --------------------------------------------------------------------------
def test_layers_an_adapter_changes_are_quantized_from_the_merged_weights(lora_llama, tmp_path):
    folder = copy_of(lora_llama.folder, tmp_path)
    path = quantize_checkpoint(folder, "bnb.nf4", "32-true")
    lora = lora_cfg(query=True, value=True)
    trained = load_model(folder, precision="32-true", lora=lora)
    randomize_lora(trained)
    adapter = adapter_of(trained, lora)
    kw = dict(precision="32-true", quantize="bnb.nf4", merge_adapter=adapter)
    merged, reference = load_model(folder, **kw), load_model(folder, use_stored=False, **kw)
    assert merged.stored_quantization == path and reference.stored_quantization is None
    changed = [n for n in quantized_layers(merged) if adapter.changes(n + ".weight")]
    assert changed and len(changed) < len(quantized_layers(merged))
    assert merged.layers_quantized_at_load == len(changed)
    assert reference.layers_quantized_at_load == len(quantized_layers(reference))
    note = load_note(merged, "bnb.nf4", torch.device("cpu"), 1.0)
    assert note == f" | quantized weights read from {path.name}; {len(changed)} layers the merged adapter changes " \
                   "quantized now"
    for name, layer in quantized_layers(merged).items():
        assert_same_stored(layer, quantized_layers(reference)[name])
    x = random_tokens(2, 7)
    assert torch.equal(merged(x), reference(x))
    # an adapter on every layer: nothing is read from the file, and the Loaded line must not say otherwise
    everything = lora_cfg()
    trained = load_model(folder, precision="32-true", lora=everything)
    randomize_lora(trained)
    assert load_model(folder, merge_adapter=adapter_of(trained, everything), precision="32-true",
                      quantize="bnb.nf4").stored_quantization is None

    # a training load: LoRA layers around the stored bases
    with_lora = load_model(folder, precision="32-true", quantize="bnb.nf4", lora=lora, seed=0)
    assert with_lora.stored_quantization == path
    assert any(isinstance(m, LoRALinear) and is_quantized(m.base) for m in with_lora.modules())
    fresh = load_model(folder, precision="32-true", quantize="bnb.nf4", lora=lora, seed=0, use_stored=False)
    for name, layer in quantized_layers(with_lora).items():
        assert_same_stored(layer, quantized_layers(fresh)[name])


def test_layers_a_residual_init_adapts_are_quantized_from_the_residual(lora_llama, tmp_path):
    """QPiSSA over a checkpoint with a stored quantization: each adapted weight gives up s*B0@A0 before it is
    quantized, so its base is bitsandbytes' quantization of that residual (as without the file); the others are read."""
    folder = copy_of(lora_llama.folder, tmp_path)
    path = quantize_checkpoint(folder, "bnb.nf4", "32-true")
    lora = replace(lora_cfg(query=True, value=True), init="pissa")
    kw = dict(precision="32-true", quantize="bnb.nf4", lora=lora, seed=0)
    ours, reference = load_model(folder, **kw), load_model(folder, use_stored=False, **kw)
    adapted = [n for n, m in ours.named_modules() if isinstance(m, LoRALinear)]
    assert ours.stored_quantization == path and ours.layers_quantized_at_load == len(adapted) > 0
    assert len(adapted) < len(quantized_layers(ours))
    for name, layer in quantized_layers(ours).items():
        assert_same_stored(layer, quantized_layers(reference)[name])


# ---- 4. generation end to end ----------------------------------------------------------------------------------
def test_generate_reads_the_stored_file_and_prints_the_same_text(train_setup, tmp_path):
    import helpers_train as h

    folder = copy_of(train_setup["ckpt"], tmp_path)
    args = ["--checkpoint_dir", folder, "--prompt", "kind dog", "--max_new_tokens", 12, "--quantize", "bnb.nf4",
            "--precision", "32-true"]
    path = quantize_checkpoint(folder, "bnb.nf4", "32-true")
    stored = h.run_script(h.GENERATE_BASE, args)
    assert stored.returncode == 0, stored.stderr
    assert f"quantized weights read from {path.name}" in stored.stderr
    path.unlink()
    fresh = h.run_script(h.GENERATE_BASE, args)
    assert fresh.returncode == 0, fresh.stderr
    assert "read from" not in fresh.stderr
    assert stored.stdout == fresh.stdout and stored.stdout.strip()


# ---- 5. bad input -----------------------------------------------------------------------------------------------
def test_quantize_checkpoint_refuses_bad_input_in_one_line(lora_llama, tmp_path, capsys):
    for args, says in (
        (["--checkpoint_dir", lora_llama.folder, "--quantize", "none"], "--quantize none stores nothing"),
        (["--checkpoint_dir", lora_llama.folder, "--quantize", "bnb.nf5"], "bnb.nf5"),
        (["--checkpoint_dir", tmp_path / "missing", "--quantize", "bnb.nf4"], "missing"),
    ):
        assert run_script_here("quantize_checkpoint.py", *args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and says in err[0], err
    assert not list(Path(lora_llama.folder).glob("lit_model.*.*.safetensors"))


def test_a_model_repacked_for_cpu_inference_is_not_stored(lora_llama, tmp_path):
    """bitsandbytes' AVX512-BF16 inference layout (an eval forward may repack a layer) is not what a load reads back."""
    from lit_qlora.quant.prequantized import write_stored

    folder = copy_of(lora_llama.folder, tmp_path)
    model = load_model(folder, precision="bf16-true", quantize="bnb.nf4")
    layer = quantized_layers(model)["transformer.h.1.attn.proj"]
    layer.weight.quant_state.packing_format_for_cpu = True  # what bitsandbytes' repacking sets
    with pytest.raises(RuntimeError, match="transformer.h.1.attn.proj was repacked"):
        write_stored(model, folder / LIT_WEIGHTS, "bnb.nf4", torch.bfloat16)
    assert not stored_path(folder / LIT_WEIGHTS, "bnb.nf4", torch.bfloat16).exists()


def test_quantize_checkpoint_again_is_a_no_op_while_the_file_matches(lora_llama, tmp_path, monkeypatch, capsys):
    folder = copy_of(lora_llama.folder, tmp_path)
    path = quantize_checkpoint(folder, "bnb.nf4", "32-true")
    written = path.stat().st_mtime_ns
    capsys.readouterr()
    forbid_quantizing(monkeypatch)
    real_access = os.access  # a read-only shared folder whose owner quantized it: nothing to write, no error
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == folder else real_access(p, mode))
    assert quantize_checkpoint(folder, "bnb.nf4", "32-true") == path
    assert "is up to date" in capsys.readouterr().err and path.stat().st_mtime_ns == written
    monkeypatch.undo()
    rewrite_scaled(folder / LIT_WEIGHTS, 2.0)  # no longer up to date: quantized and written again
    quantize_checkpoint(folder, "bnb.nf4", "32-true")
    assert "Quantized" in capsys.readouterr().err and path.stat().st_mtime_ns != written


def test_quantize_checkpoint_says_what_to_do_when_it_cannot_write(lora_llama, tmp_path, monkeypatch, capsys):
    import errno

    import lit_qlora.quant.prequantized as prequantized

    folder = copy_of(lora_llama.folder, tmp_path)
    args = ("quantize_checkpoint.py", "--checkpoint_dir", folder, "--quantize", "bnb.nf4")
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == folder else real_access(p, mode))
    assert run_script_here(*args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not writable" in err[0], err
    monkeypatch.undo()

    def disk_full(path, *a, **kw):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(prequantized, "write_safetensors_stream", disk_full)
    assert run_script_here(*args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: could not write") and "No space left" in err[0], err
    assert not any(p.name.startswith(("lit_model.bnb", ".lit_model.bnb")) for p in folder.iterdir())
