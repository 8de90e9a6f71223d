"""Checkpoint conversion both ways (bit-identical round trips, shards, .bin files, dtypes) and the convert scripts."""
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import ROOT, random_tokens, run_in_process
from helpers_bounds import SEQUENCES, assert_logits_as_close_as
from helpers_train import assert_one_line_error, env
from safetensors.torch import load_file, save_file

from lit_qlora.checkpoint import LIT_CONFIG, LIT_WEIGHTS
from lit_qlora.config import Config
from lit_qlora.convert import convert_hf_checkpoint, convert_lit_checkpoint
from tests.helpers import make_tiny_hf_model

HF_SCRIPT, LIT_SCRIPT = ROOT / "scripts/convert_hf_checkpoint.py", ROOT / "scripts/convert_lit_checkpoint.py"


def test_round_trip_is_bit_identical_and_loads_in_transformers(family_ckpt, tmp_path):
    import transformers

    out = convert_lit_checkpoint(family_ckpt.folder, tmp_path / "export")
    original, exported = load_file(family_ckpt.folder / "model.safetensors"), load_file(out / "model.safetensors")
    assert set(exported) == set(original)  # tied models: no lm_head in either
    for key, t in original.items():
        assert torch.equal(exported[key], t), key
    ours_cfg = Config.from_file(family_ckpt.folder / LIT_CONFIG)
    assert replace(Config.from_hf_config(out / "config.json"), name="") == replace(ours_cfg, name="")

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert reloaded.dtype == torch.float32  # the export declares the dtype of its weights
    idx = random_tokens(SEQUENCES, 16, seed=4)
    with torch.no_grad():
        # not bit-equal for Phi: the export names gelu_new (same tanh GELU, other kernel) gelu_pytorch_tanh
        assert_logits_as_close_as(reloaded(idx).logits, family_ckpt.hf, idx, "the export in transformers")


def write_bin_shards(state_dict: dict, folder: Path, max_bytes: int) -> None:
    """The pre-safetensors layout: pytorch_model-0000i-of-0000n.bin + pytorch_model.bin.index.json."""
    shards, size = [{}], 0
    for k, t in state_dict.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = t.contiguous().clone()
        size += n
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        name = f"pytorch_model-{i:05d}-of-{len(shards):05d}.bin"
        torch.save(shard, folder / name)
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for t in state_dict.values())
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                     "weight_map": weight_map}))


@pytest.mark.parametrize("layout", ["safetensors_shards", "bin_shards", "bin_single"])
@pytest.mark.parametrize("kind", ["llama", "gpt_neox"])
def test_sharded_and_bin_checkpoints_convert_the_same(kind, layout, tmp_path):
    reference = tmp_path / "single"
    hf = make_tiny_hf_model(kind, reference)
    convert_hf_checkpoint(reference)
    folder = tmp_path / layout
    folder.mkdir()
    hf.config.save_pretrained(folder)
    on_disk = load_file(reference / "model.safetensors")  # HF key names as saved (gpt_neox: embed_out, not lm_head)
    if layout == "safetensors_shards":
        hf.save_pretrained(folder, max_shard_size="20KB")
        assert len(list(folder.glob("model-*.safetensors"))) > 3 and (folder / "model.safetensors.index.json").is_file()
    elif layout == "bin_shards":
        write_bin_shards(on_disk, folder, max_bytes=20_000)
        assert len(list(folder.glob("pytorch_model-*.bin"))) > 3
    else:
        torch.save(on_disk, folder / "pytorch_model.bin")
    convert_hf_checkpoint(folder)
    expected, got = load_file(reference / LIT_WEIGHTS), load_file(folder / LIT_WEIGHTS)
    assert set(got) == set(expected)
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_convert_dtype(tmp_path):
    make_tiny_hf_model("qwen2", tmp_path)
    convert_hf_checkpoint(tmp_path, dtype=torch.bfloat16)
    weights = load_file(tmp_path / LIT_WEIGHTS)
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    out = convert_lit_checkpoint(tmp_path, tmp_path / "export")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


def spawn(script: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(script), *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT.parent, env=env())


@pytest.fixture(scope="module")
def broken_folders(tmp_path_factory) -> Path:
    """Folders with one thing wrong each."""
    base = tmp_path_factory.mktemp("broken_folders")
    (base / "empty").mkdir()
    (base / "bert").mkdir()
    (base / "bert" / "config.json").write_text(json.dumps({"architectures": ["BertForMaskedLM"], "model_type": "bert"}))
    shard = base / "shard"
    make_tiny_hf_model("llama", base / "shard_src").save_pretrained(shard, max_shard_size="20KB")
    lost = sorted(set(json.loads((shard / "model.safetensors.index.json").read_text())["weight_map"].values()))[1]
    (shard / lost).unlink()
    (base / "lost_shard.txt").write_text(lost)
    tensor = base / "tensor"
    make_tiny_hf_model("llama", tensor)
    sd = load_file(tensor / "model.safetensors")
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, tensor / "model.safetensors", metadata={"format": "pt"})
    for name, change in (("no_kv_heads", "num_key_value_heads"), ("other_mlp", {"intermediate_size": 96})):
        make_tiny_hf_model("llama", base / name)  # 4 heads, 2 key/value heads, MLP 128 wide
        cfg = json.loads((base / name / "config.json").read_text())
        cfg.pop(change) if isinstance(change, str) else cfg.update(change)  # a valid config of another model
        (base / name / "config.json").write_text(json.dumps(cfg))
    return base


@pytest.mark.parametrize("case", ["missing_folder", "no_config", "unsupported", "missing_shard", "missing_tensor",
                                  "export_unconverted", "export_missing_folder", "no_kv_heads", "other_mlp"])
def test_script_errors_are_one_line(broken_folders, case):
    b = broken_folders
    script, args, *expect = {
        "missing_folder": (HF_SCRIPT, ["--checkpoint_dir", b / "nope"], str(b / "nope")),
        "no_config": (HF_SCRIPT, ["--checkpoint_dir", b / "empty"], str(b / "empty" / "config.json")),
        "unsupported": (HF_SCRIPT, ["--checkpoint_dir", b / "bert"],
                        str(b / "bert" / "config.json") + ": unsupported architecture 'BertForMaskedLM'"),
        "missing_shard": (HF_SCRIPT, ["--checkpoint_dir", b / "shard"], (b / "lost_shard.txt").read_text()),
        "missing_tensor": (HF_SCRIPT, ["--checkpoint_dir", b / "tensor"], "'model.layers.1.mlp.up_proj.weight'"),
        "export_unconverted": (LIT_SCRIPT, ["--checkpoint_dir", b / "tensor", "--out_dir", b / "x"],
                               str(b / "tensor" / LIT_CONFIG)),
        "export_missing_folder": (LIT_SCRIPT, ["--checkpoint_dir", b / "nope", "--out_dir", b / "x"], str(b / "nope")),
        # config.json and the weights of two different models: the tensors do not fit the shapes the config gives
        "no_kv_heads": (HF_SCRIPT, ["--checkpoint_dir", b / "no_kv_heads"],
                        "model.layers.0.self_attn.k_proj.weight (32, 64)", "transformer.h.0.attn.qkv.weight of shape "
                        "(192, 64)", str(b / "no_kv_heads" / "config.json")),
        "other_mlp": (HF_SCRIPT, ["--checkpoint_dir", b / "other_mlp"], "model.layers.0.mlp.gate_proj.weight (128, 64)",
                      "of shape (96, 64)"),
    }[case]
    assert_one_line_error(run_in_process(script, *args), *expect)


def test_scripts_in_a_fresh_interpreter(broken_folders, tmp_path):
    """The real command lines: a user error (exit 2, one line), then convert (bf16) and export."""
    ok = tmp_path / "ok"
    make_tiny_hf_model("llama3", ok)
    (ok / "tokenizer.json").write_text("{}")
    (ok / "tokenizer_config.json").write_text("{}")
    failing, converting = spawn(HF_SCRIPT, "--checkpoint_dir", broken_folders / "tensor"), spawn(HF_SCRIPT,
                                                                                                 "--checkpoint_dir", ok,
                                                                                                 "--dtype", "bf16")
    _, err = failing.communicate(timeout=120)
    assert_one_line_error(SimpleNamespace(returncode=failing.returncode, stderr=err),
                          "'model.layers.1.mlp.up_proj.weight'")
    _, err = converting.communicate(timeout=120)
    assert converting.returncode == 0 and LIT_WEIGHTS in err, err
    assert {t.dtype for t in load_file(ok / LIT_WEIGHTS).values()} == {torch.bfloat16}

    out = tmp_path / "export"
    exporting = spawn(LIT_SCRIPT, "--checkpoint_dir", ok, "--out_dir", out)
    _, err = exporting.communicate(timeout=120)
    assert exporting.returncode == 0 and "model.safetensors" in err and "tokenizer.json" in err, err
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file(), name
    original, exported = load_file(ok / "model.safetensors"), load_file(out / "model.safetensors")
    assert set(exported) == set(original)
    assert all(torch.equal(exported[k], original[k].bfloat16()) for k in original)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


@pytest.mark.parametrize("field, value", [("attention_scale", 2.5), ("rope_base", 20000.0), ("norm_class", "LayerNorm"),
                                          ("tie_embeddings", True)])
def test_a_conversion_its_config_json_does_not_give_is_refused(tmp_path, field, value):
    """model_config.json of a converted folder with a value of the right kind that its config.json does not give (the
    file fuzzer, seed 12003: attention_scale 2.5 on a Llama loaded and changed every attention): refused in one line
    naming the field and both files; the pristine conversion loads."""
    from lit_qlora.convert import ensure_converted
    from lit_qlora.utils import UserError

    make_tiny_hf_model("llama", tmp_path)
    ensure_converted(tmp_path, quiet=True, verify=True)
    data = json.loads((tmp_path / LIT_CONFIG).read_text())
    data[field] = value
    (tmp_path / LIT_CONFIG).write_text(json.dumps(data))
    with pytest.raises(UserError) as e:
        ensure_converted(tmp_path, quiet=True)
    msg = str(e.value)
    assert "\n" not in msg and f"{tmp_path / LIT_CONFIG}: {field} is {value!r}" in msg
    assert str(tmp_path / "config.json") in msg and "convert again" in msg


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_config_json_without_the_context_length_is_refused(tmp_path, kind):
    """The fuzzer, seed 14022: config.json with max_position_embeddings deleted converted with a context of 4096,
    which is not transformers' default for the architecture (Llama 2048, Qwen2 32768): every config transformers
    saves has it, so one without is refused in one line naming the file and the field."""
    from lit_qlora.convert import ensure_converted
    from lit_qlora.utils import UserError

    make_tiny_hf_model(kind, tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    del data["max_position_embeddings"]
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(UserError) as e:
        ensure_converted(tmp_path, quiet=True)
    assert f"{tmp_path / 'config.json'} has no 'max_position_embeddings'" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("layout", ["published", "in-memory names"])
def test_multimodal_gemma3_folder_loads_its_text_model(tmp_path, layout):
    """Gemma 3 4B / 12B / 27B ship as Gemma3ForConditionalGeneration (the language model under text_config, a vision
    tower beside it): converted, our model is that language model, fp32 logits on text those of transformers'
    multimodal model's. Layouts: the published one (language_model.model.*, as transformers 5 saves it too, with a
    text_config naming only what differs from Gemma3TextConfig's defaults) and transformers' in-memory names
    (model.language_model.*)."""
    import transformers
    from helpers import TINY_HF_CONFIGS

    from lit_qlora.loader import load_model

    text = {k: v for k, v in TINY_HF_CONFIGS["gemma3"].items() if k not in ("architectures", "model_type")}
    text.pop("layer_types")  # from sliding_window_pattern, as the published configs have it
    text.update(num_hidden_layers=4, sliding_window_pattern=2, tie_word_embeddings=False)  # ignored: the top ties
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    cfg = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    torch.manual_seed(0)
    ref = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # norms away from their initial values, so a norm read from the wrong tensor shows
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    folder = tmp_path / "gemma-3-tiny-it"
    ref.save_pretrained(folder)
    sd = load_file(folder / "model.safetensors")
    assert any(k.startswith("language_model.model.layers.") for k in sd) and any("vision_tower" in k for k in sd)
    if layout == "published":
        hf = json.loads((folder / "config.json").read_text())
        hf["text_config"] = {k: v for k, v in text.items() if k != "tie_word_embeddings"}
        hf["text_config"]["model_type"] = "gemma3_text"
        hf.pop("tie_word_embeddings", None)  # tied by default
        (folder / "config.json").write_text(json.dumps(hf))
    else:
        names = (("language_model.model.", "model.language_model."), ("vision_tower.", "model.vision_tower."),
                 ("multi_modal_projector.", "model.multi_modal_projector."))
        sd = {next((n + k[len(o):] for o, n in names if k.startswith(o)), k): v for k, v in sd.items()}
        save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})
    ours = load_model(folder, precision="32-true")
    assert ours.config.hf_architecture == "Gemma3ForCausalLM" and ours.config.tie_embeddings
    assert ours.config.layer_types == ["sliding_attention", "full_attention"] * 2
    idx = random_tokens(SEQUENCES, 24)
    with torch.no_grad():
        assert_logits_as_close_as(ours(idx), ref, idx)
