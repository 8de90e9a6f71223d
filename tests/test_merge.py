"""Merging: the merged checkpoint and the HF export compute what the model with its adapter computes; a bf16
checkpoint is merged by the exact rule."""
import shutil
from dataclasses import replace

import pytest
import torch
from helpers import hf_model, lora_cfg, random_tokens, randomize_lora, run_script_here
from helpers_bounds import SEQUENCES, assert_logits_as_close_as, assert_merged_as_close_as
from safetensors.torch import load_file

from lit_qlora.adapter import Adapter
from lit_qlora.checkpoint import LIT_WEIGHTS
from lit_qlora.config import Config
from lit_qlora.convert import convert_hf_checkpoint
from lit_qlora.export.merge import merge_checkpoint
from lit_qlora.loader import load_model
from lit_qlora.lora import LoRAConfig, lora_modules


@pytest.mark.parametrize("which,variant", [("lora_llama", {}), ("lora_tied", {}),
                                           ("lora_llama", dict(dora=True, rslora=True)),
                                           ("lora_llama", dict(dora=True, init="pissa", head=False))],
                         ids=["llama", "tied", "llama-dora+rslora", "llama-dora+pissa"])
@torch.no_grad()
def test_hf_export_of_merged_model_matches(which, variant, request, tmp_path):
    """scripts/export_hf.py merges the adapter into the full-precision weights: transformers computes on the merged
    folder what our model with the adapter computes (DoRA: each adapted row scaled to its magnitude; PiSSA: the
    residual given up is added back). The adapted model's exact logits are PEFT's with our exported adapter, in
    float64: our model is as close to them as PEFT's own fp32 model, the merged folder as close as PEFT's own merge
    (tests/helpers_bounds.py)."""
    from peft import PeftModel

    tiny = request.getfixturevalue(which)
    idx = random_tokens(SEQUENCES, 12, seed=7)
    lora = replace(lora_cfg(), **variant)
    model = load_model(tiny.folder, precision="32-true", lora=lora, seed=0)
    randomize_lora(model, seed=8)
    if lora.dora:
        for m in lora_modules(model).values():
            m.lora_magnitude.mul_(1.5)
    adapter = Adapter.of_model(model, lora)
    adapter.save(tmp_path / "adapter.pth")
    adapter.export_peft(model.config, tmp_path / "peft", base_model_name_or_path=str(tiny.folder))
    peft_model = PeftModel.from_pretrained(hf_model(tiny.folder), tmp_path / "peft").eval()
    assert_logits_as_close_as(model(idx), peft_model, idx, "against PEFT")
    assert run_script_here("export_hf.py", "--checkpoint_dir", tiny.folder, "--lora_path", tmp_path / "adapter.pth",
                           "--out_dir", tmp_path / "hf") == 0
    assert not any(p.name.startswith(".merged") for p in (tmp_path / "hf").iterdir())
    assert_merged_as_close_as(hf_model(tmp_path / "hf")(idx).logits, peft_model, idx)


@torch.no_grad()
def test_merging_into_a_bf16_checkpoint_rounds_once_to_bf16(lora_tied, tmp_path):
    """A checkpoint stored in bf16 (tied head): every adapted weight becomes bf16(bf16 base + scale * B @ A computed in
    fp32), by hand from the adapter's tensors; every other tensor is copied bit for bit; the tied head gets its own
    merged copy of the embedding."""
    base = tmp_path / "bf16"
    shutil.copytree(lora_tied.folder, base, ignore=shutil.ignore_patterns("lit_model.safetensors", "model_config.json"))
    convert_hf_checkpoint(base, dtype=torch.bfloat16)
    lora = LoRAConfig(r=4, alpha=8, dropout=0.0, query=False, value=False, projection=True, mlp=True, head=True)
    model = load_model(base, precision="32-true", lora=lora, seed=0)
    randomize_lora(model, seed=3)
    adapter = Adapter.of_model(model, lora)
    merge_checkpoint(base, adapter, tmp_path / "merged")

    stored, merged = load_file(base / LIT_WEIGHTS), load_file(tmp_path / "merged" / LIT_WEIGHTS)
    assert {t.dtype for t in merged.values()} == {torch.bfloat16}
    assert set(merged) == set(stored) | {"lm_head.weight"}  # the tied head is stored once in the base
    for key, t in merged.items():
        module = key.removesuffix(".weight")
        if module + ".lora_A" in adapter.lora:
            A, B = adapter.lora[module + ".lora_A"], adapter.lora[module + ".lora_B"]
            w = stored["transformer.wte.weight" if module == "lm_head" else key]
            assert torch.equal(t, (w.float() + 2.0 * B @ A).to(torch.bfloat16)), key
        else:
            assert torch.equal(t, stored[key]), key
    assert Config.from_file(tmp_path / "merged" / "model_config.json").tie_embeddings is False
