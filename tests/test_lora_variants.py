"""LoRA variants (rsLoRA, LoRA+, DoRA) against PEFT: the same forward, gradients, optimizer groups, merges and exports
on the same weights."""
from dataclasses import replace

import pytest
import torch
from helpers import ALL, adapter_of, hf_model, lora_cfg, random_tokens, randomize_lora

from lit_qlora.adapter import Adapter
from lit_qlora.args import LoRAArgs
from lit_qlora.loader import load_model, load_model_with_adapter
from lit_qlora.lora import LoRAConfig
from lit_qlora.peft_interop import import_peft
from lit_qlora.training import loraplus_groups, make_optimizer
from lit_qlora.utils import UserError

QV = dict(query=True, value=True)


def test_rslora_scaling_is_alpha_over_sqrt_r():
    assert LoRAConfig(r=16, alpha=8, rslora=True).scaling == 2.0
    assert LoRAConfig(r=16, alpha=8).scaling == 0.5
    assert LoRAConfig(rslora=True).targets() == ["query", "value"]  # a variant flag is no target


@pytest.mark.parametrize("which,targets", [("lora_llama", ALL), ("lora_neox", QV), ("lora_falcon40b", ALL),
                                           ("lora_phi3", ALL)],
                         ids=["llama-all", "neox-qv", "falcon40b-all", "phi3-all"])
@torch.no_grad()
def test_rslora_export_runs_in_peft_and_comes_back(which, targets, request, tmp_path):
    from peft import PeftModel

    tiny = request.getfixturevalue(which)
    lora = replace(lora_cfg(**targets), rslora=True, loraplus_lr_ratio=16.0)
    model = load_model(tiny.folder, precision="32-true", lora=lora, seed=0)
    randomize_lora(model, seed=4)
    idx = random_tokens(2, 12, seed=3)
    expected = model(idx)
    adapter = adapter_of(model, lora)
    adapter.save(tmp_path / "a.pth")
    again = Adapter.load(tmp_path / "a.pth")  # recorded in the adapter: loads with no flags
    assert again.config == lora
    assert (load_model_with_adapter(tiny.folder, again, precision="32-true")(idx) - expected).abs().max() == 0
    adapter.export_peft(tiny.config, tmp_path / "peft")
    peft_model = PeftModel.from_pretrained(hf_model(tiny.folder), tmp_path / "peft").eval()
    assert peft_model.peft_config["default"].use_rslora
    assert (peft_model(idx).logits - expected).abs().max().item() <= 1e-4
    _, back, _ = import_peft(tmp_path / "peft", tiny.config)
    assert back == lora


@torch.no_grad()
def test_rslora_merge_matches_peft_merge(lora_llama, tmp_path):
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(hf_model(lora_llama.folder), LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, use_rslora=True, target_modules=["q_proj", "down_proj"],
        task_type="CAUSAL_LM"))
    g = torch.Generator().manual_seed(5)
    for name, p in peft_model.named_parameters():
        if "lora_" in name:
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    peft_model.save_pretrained(tmp_path / "peft")
    adapter = Adapter.load(tmp_path / "peft", lora_llama.config)
    assert adapter.config.rslora and adapter.config.alpha == pytest.approx(8)
    merged = peft_model.merge_and_unload()
    ref = merged.model.layers[1].self_attn.q_proj.weight
    from safetensors.torch import load_file
    base = load_file(lora_llama.folder / "lit_model.safetensors")
    ours = adapter.merged("transformer.h.1.attn.qkv.weight", base["transformer.h.1.attn.qkv.weight"])
    assert (ours[:ref.shape[0]] - ref).abs().max().item() <= 1e-6


def _kind(name: str) -> str:
    return next(k for k in ("lora_A", "lora_B", "lora_magnitude") if k in name)


def test_loraplus_groups_as_peft(lora_llama):
    """The same kinds of parameters in the same groups at the same learning rates as PEFT's create_loraplus_optimizer
    (DoRA on, so its 1-D magnitudes are grouped too)."""
    from peft import LoraConfig, get_peft_model
    from peft.optimizers import create_loraplus_optimizer

    peft_model = get_peft_model(hf_model(lora_llama.folder), LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], use_dora=True, task_type="CAUSAL_LM"))
    ref = create_loraplus_optimizer(peft_model, torch.optim.AdamW, lr=1e-3, loraplus_lr_ratio=16.0)
    names = {id(p): n for n, p in peft_model.named_parameters()}
    ref_groups = {g["lr"]: {_kind(names[id(p)]) for p in g["params"]} for g in ref.param_groups if g["params"]}
    assert ref_groups == {1e-3: {"lora_A"}, 16e-3: {"lora_B", "lora_magnitude"}}
    named = [("x.lora_A", torch.nn.Parameter(torch.zeros(4, 8))), ("x.lora_B", torch.nn.Parameter(torch.zeros(8, 4))),
             ("x.lora_magnitude", torch.nn.Parameter(torch.zeros(8)))]
    ours = make_optimizer("AdamW", loraplus_groups(named, 1e-3, 16.0), 1e-3, 0.0, "cpu")
    names = {id(p): n for n, p in named}
    assert {g["lr"]: {_kind(names[id(p)]) for p in g["params"]} for g in ours.param_groups} == ref_groups
    assert make_optimizer("AdamW", loraplus_groups(named, 1e-3, None), 1e-3, 0.0, "cpu").param_groups[0]["lr"] == 1e-3


def test_loraplus_flag_is_checked():
    with pytest.raises(UserError, match="--loraplus_lr_ratio must be a number above 0"):
        LoRAArgs(loraplus_lr_ratio=0)
    assert LoRAArgs(lora_rslora=True, loraplus_lr_ratio=4).config() == LoRAConfig(rslora=True, loraplus_lr_ratio=4)
