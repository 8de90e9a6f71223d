"""LoRA: exactness of the adapter and of merging, PEFT interop both ways, HF export, base checks, cross-loading."""
import dataclasses

import pytest
import torch
from helpers import VOCAB, lora_cfg, random_tokens, randomize_lora, run_script_here
from torch import nn

from lit_qlora.adapter import Adapter
from lit_qlora.loader import load_model
from lit_qlora.lora import LoRALinear, _DropoutMatmul, lora_modules
from lit_qlora.model import activate, gated_activation


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


def test_decoding_steps_compute_the_lora_products_in_fp32(lora_tied, monkeypatch):
    """A bf16 generation step (a few rows, no autograd) computes the LoRA products in fp32 (tiny 16-bit CPU matmuls
    are several times slower): every adapted layer takes that path, the logits agree with the general (autograd)
    path to bf16 precision, and they are at least as close to an fp32 model with the same weights."""
    cfg = lora_cfg()  # every target: a fused qkv with three parts, the MLP, the tied head's own LoRA
    model = load_model(lora_tied.folder, precision="bf16-true", lora=cfg, seed=0).eval()
    randomize_lora(model)
    ref = load_model(lora_tied.folder, precision="32-true", lora=cfg, seed=0).eval()
    ref.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    taken = []
    decoding = LoRALinear._decoding
    monkeypatch.setattr(LoRALinear, "_decoding", lambda self, x: taken.append(decoding(self, x)) or taken[-1])
    idx = random_tokens(2, 5)
    with torch.no_grad():
        fast = model(idx).float()
    assert len(taken) == len(lora_modules(model)) and all(taken)
    general = model(idx).detach().float()  # autograd on: the training path
    with torch.no_grad():
        exact = ref(idx)
    scale = exact.abs().max().item()
    assert (fast - general).abs().max().item() <= 2e-2 * scale
    assert (fast - exact).abs().max().item() <= 1.05 * (general - exact).abs().max().item() + 1e-3 * scale


def test_decoding_steps_see_every_change_of_the_adapter(lora_tied):
    """Decoding steps keep fp32 copies of A and B; they are made again whenever the adapter changes (an in-place
    update as an optimizer step makes it, a loaded state dict, a replaced parameter), so each step equals the same
    step of a fresh model holding the same weights; train() drops them."""
    cfg = lora_cfg()
    model = load_model(lora_tied.folder, precision="bf16-true", lora=cfg, seed=0).eval()
    randomize_lora(model)
    idx = random_tokens(1, 3)

    @torch.no_grad()
    def fresh():
        other = load_model(lora_tied.folder, precision="bf16-true", lora=cfg, seed=0).eval()
        other.load_state_dict(model.state_dict())
        return other(idx)

    step = torch.no_grad()(lambda: model(idx))
    before = step()
    assert torch.equal(before, fresh())
    mods = list(lora_modules(model).values())
    assert all("_decode_cache" in m.__dict__ for m in mods)  # the copies were made
    with torch.no_grad():
        for m in mods:
            m.lora_B.mul_(1.5)
    after = step()
    assert not torch.equal(after, before) and torch.equal(after, fresh())
    model.load_state_dict({k: v * 0.5 if "lora_A" in k else v for k, v in model.state_dict().items()})
    assert torch.equal(step(), fresh())
    mods[0].lora_A = nn.Parameter(torch.randn_like(mods[0].lora_A))
    assert torch.equal(step(), fresh())
    model.train()
    assert not any("_decode_cache" in m.__dict__ for m in mods)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_lora_dropout_function_equals_autograd_with_the_same_mask(p):
    """LoRALinear's dropout-and-matmul (it saves x and a one-byte mask) against plain autograd ops given the same mask
    (the same draws from torch's generator): output and both gradients."""
    x = torch.randn(2, 7, 16, requires_grad=True)
    A = torch.randn(6, 16, requires_grad=True)
    torch.manual_seed(3)
    y = _DropoutMatmul.apply(x, A, p)
    torch.manual_seed(3)
    keep = torch.empty(x.shape, dtype=torch.int32).random_() >= round(p * 2**31)  # the same draws
    x2, A2 = x.detach().clone().requires_grad_(), A.detach().clone().requires_grad_()
    y2 = (x2 * keep / (1 - p)) @ A2.T
    assert_same_output_and_grads(y, y2, [(x, x2), (A, A2)])


@pytest.mark.parametrize("p", [0.05, 0.1, 0.5])
def test_lora_dropout_mask_is_nn_dropouts_distribution(p):
    """The mask drawn as 31-bit integers drops a share p of the elements (within 5 standard deviations over 2M
    draws, like nn.Dropout's), independently: the dropped share of one half of the elements does not depend on the
    other half, and the output keeps its mean (scaled by 1 / (1 - p))."""
    n = 2_000_000
    x = torch.ones(n, 1)
    A = torch.ones(1, 1)
    torch.manual_seed(5)
    y = _DropoutMatmul.apply(x, A, p)[:, 0]
    kept = y != 0
    sd = (p * (1 - p) / n) ** 0.5
    assert abs(float(kept.float().mean()) - (1 - p)) < 5 * sd
    assert abs(float(y.mean()) - 1.0) < 5 * sd / (1 - p)
    even, odd = kept[0::2], kept[1::2]  # neighbours (e.g. two halves of one 64-bit draw) must be independent
    both = float((even & odd).float().mean())
    assert abs(both - (1 - p) ** 2) < 5 * (2 * sd)
    torch.manual_seed(5)
    ref = nn.Dropout(p).train()(x)[:, 0] != 0
    assert abs(float(ref.float().mean()) - float(kept.float().mean())) < 10 * sd


@pytest.mark.parametrize("kind", ["silu", "gelu", "gelu_tanh"])
def test_gated_activation_function_equals_autograd(kind):
    """The gated MLP's act(a) * b, which recomputes act(a) in backward, against plain autograd."""
    a, b = torch.randn(3, 5, 12, requires_grad=True), torch.randn(3, 5, 12, requires_grad=True)
    a2, b2 = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    y, y2 = gated_activation(a, b, kind), activate(a2, kind) * b2
    assert_same_output_and_grads(y, y2, [(a, a2), (b, b2)])
    # with a per-row scale (a mixture of experts' routing weights), which gets its gradient too
    s = torch.rand(3, 5, 1, requires_grad=True)
    a2, b2, s2 = (t.detach().clone().requires_grad_() for t in (a, b, s))
    y, y2 = gated_activation(a, b, kind, s), activate(a2, kind) * b2 * s2
    a.grad = b.grad = None
    assert_same_output_and_grads(y, y2, [(a, a2), (b, b2), (s, s2)])


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_gated_mlp_remakes_the_down_projections_input_in_backward(lora_tied, dropout):
    """With a LoRA on the down projection, a training forward keeps act(a) * b nowhere (model.saved_as_recomputed:
    remade from a and b in backward): the gradients equal those of the same forward keeping it, bit for bit, and
    saved-tensor hooks the caller installed still see every other tensor (which the remade one never reaches)."""
    lora = dataclasses.replace(lora_cfg(mlp=True), dropout=dropout)
    model = load_model(lora_tied.folder, precision="32-true", lora=lora, seed=1)
    randomize_lora(model)
    model.train()
    mlps = [b.mlp for b in model.transformer.h]
    idx = random_tokens(2, 12)
    inner = model.config.intermediate_size

    def run(remake: bool) -> tuple[dict, int]:
        for m in mlps:
            m.recompute_proj_input = remake
        model.zero_grad()
        torch.manual_seed(0)  # the same dropout masks
        widths = []  # numel of each tensor saved

        def pack(t):
            widths.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(idx, targets=idx, lm_head_chunk=0)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        return grads, widths.count(idx.numel() * inner)  # [2, 12, intermediate] tensors

    kept, kept_wide = run(False)
    remade, remade_wide = run(True)
    assert kept.keys() == remade.keys() and all(torch.equal(kept[n], remade[n]) for n in kept)
    # per block: a and b (the activation's inputs), with dropout its keep mask; act(a) * b itself only when kept
    per_block = 3 if dropout else 2
    assert remade_wide == per_block * len(mlps) and kept_wide == (per_block + 1) * len(mlps)


def assert_same_output_and_grads(y, y_ref, inputs: list) -> None:
    """y equals y_ref, and after backpropagating one random gradient through both, each input's gradient equals its
    reference twin's."""
    torch.testing.assert_close(y, y_ref)
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    for t, t_ref in inputs:
        torch.testing.assert_close(t.grad, t_ref.grad)
