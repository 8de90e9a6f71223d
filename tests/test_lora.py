"""LoRA: exactness of the adapter and of merging, PEFT interop both ways, HF export, base checks, cross-loading."""


















import torch
from helpers import VOCAB, lora_cfg, random_tokens, randomize_lora, run_script_here

from lit_qlora.adapter import Adapter
from lit_qlora.loader import load_model
from lit_qlora.lora import lora_modules


@torch.no_grad()
def test_zero_b_is_the_base_model_and_merging_is_exact(lora_ckpt, tmp_path):
    idx = random_tokens(2, 12)
    base = load_model(lora_ckpt.folder, precision="32-true")(idx)
    lora = lora_cfg()
    model = load_model(lora_ckpt.folder, precision="32-true", lora=lora, seed=1)
    assert all(m.lora_B.abs().max() == 0 for m in lora_modules(model).values())
    assert torch.equal(model(idx), base)

    randomize_lora(model)
    unmerged = model(idx)
    assert (unmerged - base).abs().max() > 1e-2  # the adapter does something
    adapter_path = tmp_path / "adapter.pth"
    Adapter.of_model(model, lora).save(adapter_path)

    merged_on_load = load_model(lora_ckpt.folder, precision="32-true", merge_adapter=Adapter.load(adapter_path))
    assert (merged_on_load(idx) - unmerged).abs().max().item() <= 1e-5  # generate's merge: added as the weights load

    out = tmp_path / "merged"  # on disk, from the stored base weights
    assert run_script_here("merge_lora.py", "--checkpoint_dir", lora_ckpt.folder, "--lora_path", adapter_path,
                           "--out_dir", out) == 0
    assert {"lit_model.safetensors", "model_config.json"} <= {p.name for p in out.iterdir()}
    merged = load_model(out, precision="32-true")
    assert merged.config.tie_embeddings is False
    assert (merged(idx) - unmerged).abs().max().item() <= 1e-5
    assert load_model(out, precision="32-true", quantize="bnb.nf4")(idx).shape == (2, 12, VOCAB)  # re-quantizes
