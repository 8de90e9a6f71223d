"""Merging: the merged checkpoint and the HF export compute what the model with its adapter computes."""
import pytest
import torch
from helpers import hf_model, lora_cfg, random_tokens, randomize_lora, run_script_here

from lit_qlora.adapter import Adapter
from lit_qlora.loader import load_model


@pytest.mark.parametrize("which", ["lora_llama", "lora_tied"])
@torch.no_grad()
def test_hf_export_of_merged_model_matches(which, request, tmp_path):
    tiny = request.getfixturevalue(which)
    idx = random_tokens(2, 12, seed=7)
    lora = lora_cfg()
    model = load_model(tiny.folder, precision="32-true", lora=lora, seed=0)
    randomize_lora(model, seed=8)
    expected = model(idx)
    Adapter.of_model(model, lora).save(tmp_path / "adapter.pth")
    assert run_script_here("export_hf.py", "--checkpoint_dir", tiny.folder, "--lora_path", tmp_path / "adapter.pth",
                           "--out_dir", tmp_path / "hf") == 0
    assert not any(p.name.startswith(".merged") for p in (tmp_path / "hf").iterdir())
    assert (hf_model(tmp_path / "hf")(idx).logits - expected).abs().max().item() <= 1e-4
