"""PEFT interop both ways: our exports run in peft, peft-made adapters import exactly, what cannot be represented is
refused."""
import json
from pathlib import Path

import pytest
import torch
from helpers import ALL, adapter_of, hf_model, lora_cfg, random_tokens, randomize_lora, run_script_here
from helpers_bounds import SEQUENCES, assert_logits_as_close_as

from lit_qlora.adapter import Adapter
from lit_qlora.export.peft_interop import import_peft
from lit_qlora.loader import load_model, load_model_with_adapter
from lit_qlora.utils import UserError

PEFT_TARGETS = {
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"],
    # transformers 5 calls GPT-NeoX's head lm_head (embed_out before): name both so either version adapts it
    "gpt_neox": ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h", "embed_out", "lm_head"],
    "falcon": ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h", "lm_head"],
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"],
}


QV = dict(query=True, value=True)


@pytest.mark.parametrize("which,targets", [
    ("lora_llama", ALL), ("lora_neox", ALL), ("lora_llama", QV), ("lora_neox", QV), ("lora_tied", ALL),
    ("lora_falcon7b", ALL), ("lora_falcon7b", QV), ("lora_falcon40b", ALL), ("lora_falcon40b", QV),
    ("lora_phi3", ALL), ("lora_phi3", dict(mlp=True))],
    ids=["llama-all", "neox-all", "llama-qv", "neox-qv", "tied-all", "falcon7b-all", "falcon7b-qv", "falcon40b-all",
         "falcon40b-qv", "phi3-all", "phi3-mlp"])
@torch.no_grad()
def test_exported_adapter_runs_in_peft(which, targets, request, tmp_path):
    from peft import PeftModel

    tiny = request.getfixturevalue(which)
    idx = random_tokens(SEQUENCES, 12, seed=3)
    lora = lora_cfg(**targets)
    model = load_model(tiny.folder, precision="32-true", lora=lora, seed=0)
    randomize_lora(model, seed=4)
    expected = model(idx)
    adapter = adapter_of(model, lora)
    adapter.export_peft(tiny.config, tmp_path / "peft", base_model_name_or_path=str(tiny.folder))

    peft_model = PeftModel.from_pretrained(hf_model(tiny.folder), tmp_path / "peft").eval()
    assert_logits_as_close_as(expected, peft_model, idx, "against PEFT")

    back_lora, back_config, _ = import_peft(tmp_path / "peft", tiny.config)  # our own export comes back as it was
    assert back_config == adapter.config
    assert back_lora.keys() == adapter.lora.keys()
    for k, v in adapter.lora.items():
        assert torch.equal(back_lora[k], v), k


@pytest.mark.parametrize("which,peft_targets,rslora", [
    ("lora_llama", PEFT_TARGETS["llama"], False), ("lora_neox", PEFT_TARGETS["gpt_neox"], False),
    ("lora_llama", ["q_proj", "v_proj"], False),
    ("lora_llama", ["o_proj", "down_proj"], False), ("lora_llama", PEFT_TARGETS["llama"], True),
    ("lora_neox", "all-linear", False), ("lora_tied", PEFT_TARGETS["llama"], False),
    ("lora_falcon7b", PEFT_TARGETS["falcon"], False), ("lora_falcon40b", PEFT_TARGETS["falcon"], False),
    ("lora_phi3", PEFT_TARGETS["phi3"], False), ("lora_phi3", ["gate_up_proj"], False)],
    ids=["llama-all", "neox-all", "llama-qv", "llama-partial-mlp", "llama-rslora", "neox-all-linear", "tied-all",
         "falcon7b-all", "falcon40b-all", "phi3-all", "phi3-gate-up-only"])
@torch.no_grad()
def test_peft_made_adapter_imports_exactly(which, peft_targets, rslora, request, tmp_path):
    from peft import LoraConfig, get_peft_model

    tiny = request.getfixturevalue(which)
    peft_model = get_peft_model(hf_model(tiny.folder),
                                LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, use_rslora=rslora,
                                                                  target_modules=peft_targets, task_type="CAUSAL_LM"))
    g = torch.Generator().manual_seed(5)
    for name, p in peft_model.named_parameters():
        if "lora_" in name:
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    idx = random_tokens(SEQUENCES, 12, seed=6)
    peft_model.eval().save_pretrained(tmp_path / "peft")

    adapter = Adapter.load(tmp_path / "peft", tiny.config)  # a folder: goes through import_peft
    assert adapter.train["source"] == "peft"
    if isinstance(peft_targets, list) and len(peft_targets) > 4:
        assert adapter.config.targets() == list(ALL)
    ours = load_model_with_adapter(tiny.folder, adapter, precision="32-true")
    assert_logits_as_close_as(ours(idx), peft_model, idx, "against PEFT")


def _save_peft(lora_ckpt, tmp_path, **kw) -> Path:
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(hf_model(lora_ckpt.folder), LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM", **kw))
    peft_model.save_pretrained(tmp_path / "peft")
    return tmp_path / "peft"


def test_peft_import_refuses_what_it_cannot_represent(lora_llama, tmp_path):
    folder = _save_peft(lora_llama, tmp_path / "a", target_modules=["q_proj", "v_proj"], layers_to_transform=[0])
    with pytest.raises(UserError, match=r"layers \[0\] only"):
        import_peft(folder, lora_llama.config)
    folder = _save_peft(lora_llama, tmp_path / "b", target_modules=["q_proj", "v_proj"], rank_pattern={"v_proj": 2})
    with pytest.raises(UserError, match="different ranks"):
        import_peft(folder, lora_llama.config)
    folder = _save_peft(lora_llama, tmp_path / "c", target_modules=["q_proj", "v_proj"])
    from safetensors.torch import load_file, save_file

    sd = load_file(folder / "adapter_model.safetensors")
    save_file({k: v for k, v in sd.items() if "layers.1.self_attn.v_proj.lora_B" not in k},
              folder / "adapter_model.safetensors")
    with pytest.raises(UserError, match="no lora_B weight for model.layers.1.self_attn.v_proj"):
        import_peft(folder, lora_llama.config)
    save_file({k: v for k, v in sd.items() if "layers.1.self_attn.v_proj" not in k},
              folder / "adapter_model.safetensors")
    with pytest.raises(UserError, match="holds no LoRA weights for it"):
        import_peft(folder, lora_llama.config)


def test_an_adapter_config_without_peft_type_is_refused_as_peft_refuses_it(lora_llama, tmp_path):
    """adapter_config.json replaced by {"a": 1} (the file fuzzer, seed 12000) loaded with default settings; PEFT's
    own PeftConfig.from_pretrained refuses a config without peft_type, and so do we, in one line naming the file."""
    from peft import PeftConfig

    folder = _save_peft(lora_llama, tmp_path, target_modules=["q_proj", "v_proj"])
    (folder / "adapter_config.json").write_text(json.dumps({"a": 1}))
    with pytest.raises(TypeError, match="peft_type"):
        PeftConfig.from_pretrained(str(folder))
    with pytest.raises(UserError) as e:
        import_peft(folder, lora_llama.config)
    assert "\n" not in str(e.value) and str(folder / "adapter_config.json") in str(e.value)
    assert "'peft_type'" in str(e.value)


@pytest.mark.parametrize("damage, message", [
    (lambda c: c.pop("lora_alpha"), "has no 'lora_alpha'"),
    (lambda c: c.update(lora_alpha=10**18), "lora_alpha is 1000000000000000000, expected at most 2147483647"),
    (lambda c: c.update(r=None), "has no 'r'"),
])
def test_an_adapter_config_with_its_rank_or_alpha_lost_is_refused(lora_llama, tmp_path, damage, message):
    """The file fuzzer (seeds 18033, 22014, 22031): lora_alpha's key damaged ('lora_alphaaa...') was read with
    PEFT's default alpha 8 instead of the adapter's 16 (PEFT does the same, with a warning that the key is unknown),
    an alpha of 10**18 scaled the update by 10**18, a null r was a TypeError. save_pretrained always writes both."""
    folder = _save_peft(lora_llama, tmp_path, target_modules=["q_proj", "v_proj"])
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["lora_alpha"] and config["r"]
    damage(config)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(UserError) as e:
        import_peft(folder, lora_llama.config)
    assert "\n" not in str(e.value) and str(folder / "adapter_config.json") in str(e.value) and message in str(e.value)


def test_export_peft_script(lora_llama, tmp_path):
    model = load_model(lora_llama.folder, precision="32-true", lora=lora_cfg(), seed=0)
    Adapter.of_model(model, lora_cfg()).save(tmp_path / "adapter.pth")
    assert run_script_here("export_peft.py", "--lora_path", tmp_path / "adapter.pth", "--checkpoint_dir",
                           lora_llama.folder, "--out_dir", tmp_path / "peft") == 0
    cfg = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["task_type"] == "CAUSAL_LM" and cfg["r"] == 4 and cfg["lora_alpha"] == 8
    assert sorted(cfg["target_modules"]) == sorted(PEFT_TARGETS["llama"])
    assert cfg["rank_pattern"] == {} and cfg["alpha_pattern"] == {}


def test_a_dense_adapter_whose_config_has_another_revision_still_imports(lora_llama, tmp_path):
    """adapter_config.json with revision null -> true (the file fuzzer, seed 13046, after the MoE LoRA merge): the
    import reached the experts' conversion on a dense model (AttributeError on its moe_params); the LoRA weights
    import as they do with the config as saved."""
    folder = _save_peft(lora_llama, tmp_path, target_modules=["q_proj", "v_proj"])
    want, _, _ = import_peft(folder, lora_llama.config)
    cfg = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**cfg, "revision": True}))
    got, _, _ = import_peft(folder, lora_llama.config)
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("damage", ["key", "value"])
def test_our_exports_damaged_record_is_refused(lora_llama, tmp_path, damage):
    """The file fuzzer (seed 15011): a byte flip turned the metadata key lit_qlora_lora_config of our own export into
    lit_qlora_lnra_config, and the import read the file as another tool's, silently dropping what only that record
    keeps (the exact alpha, LoRA+'s ratio, how a fused layer's LoRA splits); a record that is no JSON object was read
    past the same way. Both are refused naming the folder; the intact export imports."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    model = load_model(lora_llama.folder, precision="32-true", lora=lora_cfg(query=True, value=True))
    randomize_lora(model)
    folder = adapter_of(model, lora_cfg(query=True, value=True)).export_peft(lora_llama.config, tmp_path / "peft")
    import_peft(folder, lora_llama.config)
    weights = folder / "adapter_model.safetensors"
    with safe_open(str(weights), "pt") as f:
        tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata())
    if damage == "key":
        meta["lit_qlora_lnra_config"] = meta.pop("lit_qlora_lora_config")
    else:
        meta["lit_qlora_lora_config"] = meta["lit_qlora_lora_config"][:-1]
    save_file(tensors, str(weights), metadata=meta)
    with pytest.raises(UserError) as e:
        import_peft(folder, lora_llama.config)
    assert f"PEFT adapter {folder}" in str(e.value) and "the file is damaged" in str(e.value)
    assert "\n" not in str(e.value)
