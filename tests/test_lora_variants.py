"""LoRA variants (rsLoRA, LoRA+, DoRA) against PEFT: the same forward, gradients, optimizer groups, merges and exports
on the same weights."""
import shutil
from dataclasses import replace

import pytest
import torch
from helpers import ALL, adapter_of, hf_4bit, hf_model, lora_cfg, random_tokens, randomize_lora
from helpers_bounds import SEQUENCES, assert_logits_as_close_as, assert_merged_as_close_as

from lit_qlora.adapter import Adapter
from lit_qlora.args import LoRAArgs
from lit_qlora.export.peft_interop import import_peft
from lit_qlora.loader import load_model, load_model_with_adapter
from lit_qlora.lora import LoRAConfig, lora_modules
from lit_qlora.train.training import loraplus_groups, make_optimizer
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
    idx = random_tokens(SEQUENCES, 12, seed=3)
    expected = model(idx)
    adapter = adapter_of(model, lora)
    adapter.save(tmp_path / "a.pth")
    again = Adapter.load(tmp_path / "a.pth")  # recorded in the adapter: loads with no flags
    assert again.config == lora
    assert (load_model_with_adapter(tiny.folder, again, precision="32-true")(idx) - expected).abs().max() == 0
    adapter.export_peft(tiny.config, tmp_path / "peft")
    peft_model = PeftModel.from_pretrained(hf_model(tiny.folder), tmp_path / "peft").eval()
    assert peft_model.peft_config["default"].use_rslora
    assert_logits_as_close_as(expected, peft_model, idx, "against PEFT")
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
    with pytest.raises(UserError, match="--loraplus_lr_ratio is 0; it must be a number above 0"):
        LoRAArgs(loraplus_lr_ratio=0)
    assert LoRAArgs(lora_rslora=True, loraplus_lr_ratio=4).config() == LoRAConfig(rslora=True, loraplus_lr_ratio=4)


# ---- DoRA --------------------------------------------------------------------------------------------------------
def _peft_dora_layer(base: torch.nn.Module, r: int, alpha: float, rslora: bool = False):
    from peft import LoraConfig
    from peft.tuners.lora import Linear as PeftLoraLinear

    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, use_dora=True, use_rslora=rslora)
    return PeftLoraLinear(base, "default", config, r=r, lora_alpha=alpha)


@pytest.mark.parametrize("rslora", [False, True], ids=["dora", "dora+rslora"])
def test_dora_forward_and_gradients_equal_peft(rslora):
    """fp32, a dense base with a bias: ours and PEFT's DoRA layer on the same weights give the same output and the
    same gradients for A, B, the magnitudes and the input."""
    from lit_qlora.lora import LoRALinear

    torch.manual_seed(0)
    base = torch.nn.Linear(24, 40, bias=True)
    ref = _peft_dora_layer(torch.nn.Linear(24, 40, bias=True), 4, 8, rslora)
    ref.base_layer.load_state_dict(base.state_dict())
    ours = LoRALinear(base, 24, 40, 4, 8, 0.0, rslora=rslora, dora=True)
    ours.reset_lora_parameters()
    ours.init_dora(base.weight)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        ref.lora_A["default"].weight.copy_(torch.randn(4, 24, generator=g) * 0.3)
        ref.lora_B["default"].weight.copy_(torch.randn(40, 4, generator=g) * 0.3)
        ref.lora_magnitude_vector["default"].weight.mul_(1 + 0.2 * torch.randn(40, generator=g))
        ours.lora_A.copy_(ref.lora_A["default"].weight)
        ours.lora_B.copy_(ref.lora_B["default"].weight)
        ours.lora_magnitude.copy_(ref.lora_magnitude_vector["default"].weight)
    x = torch.randn(3, 5, 24, generator=g)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ours.train()(xa), ref.train()(xb)
    assert (ya - yb).abs().max().item() <= 1e-5
    w = torch.randn(ya.shape, generator=g)
    (ya * w).sum().backward()
    (yb * w).sum().backward()
    pairs = [(xa.grad, xb.grad), (ours.lora_A.grad, ref.lora_A["default"].weight.grad),
             (ours.lora_B.grad, ref.lora_B["default"].weight.grad),
             (ours.lora_magnitude.grad, ref.lora_magnitude_vector["default"].weight.grad)]
    for a, b in pairs:
        assert (a - b).abs().max().item() <= 1e-5 * max(1.0, b.abs().max().item())


@pytest.mark.parametrize("mode", [None, "bnb.nf4-dq"], ids=["dense", "nf4-dq"])
def test_dora_with_dropout_equals_peft_on_the_same_mask(mode, monkeypatch):
    """Dropout on: PEFT's DoRA multiplies the dropped-out input by the base weight once more (the W x' of its
    formula); ours runs x, x' and A's rows through the base layer in one call. With the same dropout mask in both
    (ours drawn by lora.dropout_keep, PEFT's nn.Dropout replaced by the same mask), the same output and gradients of
    A, B, the magnitudes and the input, over a dense base with a bias and over nf4-dq. Red with the W (x - x') term
    left out."""
    import copy

    from helpers import reference_layer
    from peft import LoraConfig
    from peft.tuners.lora import Linear as PeftLoraLinear
    from peft.tuners.lora.bnb import Linear4bit as PeftLinear4bit

    from lit_qlora import lora as lora_module
    from lit_qlora.lora import LoRALinear
    from lit_qlora.quant.quantize import dequantize_weight

    g = torch.Generator().manual_seed(4)
    if mode is None:
        base = torch.nn.Linear(24, 40, bias=True)
        with torch.no_grad():
            base.weight.copy_(torch.randn(40, 24, generator=g) * 0.2)
            base.bias.copy_(torch.randn(40, generator=g))
        ref = PeftLoraLinear(copy.deepcopy(base), "default", LoraConfig(r=4, lora_alpha=8, lora_dropout=0.25,
                                                                        use_dora=True), r=4, lora_alpha=8)
    else:
        base = reference_layer(mode, torch.randn(40, 64, generator=g) * 0.1, torch.float32)
        ref = PeftLinear4bit(copy.deepcopy(base), "default", LoraConfig(r=4, lora_alpha=8, lora_dropout=0.25,
                                                                        use_dora=True), r=4, lora_alpha=8)
    k = base.in_features
    ours = LoRALinear(base, k, 40, 4, 8, 0.25, dora=True)
    ours.reset_lora_parameters()
    ours.init_dora(dequantize_weight(base) if mode else base.weight)
    with torch.no_grad():
        ref.lora_A["default"].weight.copy_(torch.randn(4, k, generator=g) * 0.3)
        ref.lora_B["default"].weight.copy_(torch.randn(40, 4, generator=g) * 0.3)
        ref.lora_magnitude_vector["default"].weight.mul_(1 + 0.3 * torch.randn(40, generator=g))
        ours.lora_A.copy_(ref.lora_A["default"].weight)
        ours.lora_B.copy_(ref.lora_B["default"].weight)
        ours.lora_magnitude.copy_(ref.lora_magnitude_vector["default"].weight)
    x = torch.randn(3, 5, k, generator=g)
    keep = torch.rand(15, k, generator=g) >= 0.25
    monkeypatch.setattr(lora_module, "dropout_keep", lambda t, p: keep)

    class SameMask(torch.nn.Module):
        def forward(self, t):
            return torch.where(keep.view(t.shape), t, 0) / 0.75

    ref.lora_dropout["default"] = SameMask()
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ours.train()(xa), ref.train()(xb)
    assert (ya - yb).abs().max().item() <= 1e-5
    w = torch.randn(ya.shape, generator=g)
    (ya * w).sum().backward()
    (yb * w).sum().backward()
    for a, b in [(xa.grad, xb.grad), (ours.lora_A.grad, ref.lora_A["default"].weight.grad),
                 (ours.lora_B.grad, ref.lora_B["default"].weight.grad),
                 (ours.lora_magnitude.grad, ref.lora_magnitude_vector["default"].weight.grad)]:
        assert (a - b).abs().max().item() <= 1e-5 * max(1.0, b.abs().max().item())


@pytest.mark.parametrize("mode", ["bnb.nf4", "bnb.nf4-dq", "bnb.fp4", "bnb.fp4-dq", "bnb.int8"])
def test_dora_over_a_quantized_base_equals_peft_bnb_dora(mode):
    """fp32 compute, the same bitsandbytes layer (every --quantize mode) under ours and under PEFT's bnb Linear4bit /
    Linear8bitLt DoRA layer: the same output and gradients (PEFT dequantizes the whole weight for its norms; ours
    never does after init)."""
    import copy

    from helpers import reference_layer
    from peft import LoraConfig
    from peft.tuners.lora.bnb import Linear4bit as PeftLinear4bit
    from peft.tuners.lora.bnb import Linear8bitLt as PeftLinear8bitLt

    from lit_qlora.lora import LoRALinear
    from lit_qlora.quant.quantize import dequantize_weight

    g = torch.Generator().manual_seed(3)
    base = reference_layer(mode, torch.randn(48, 64, generator=g) * 0.1, torch.float32)
    layer = PeftLinear8bitLt if mode == "bnb.int8" else PeftLinear4bit
    ref = layer(copy.deepcopy(base), "default", LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, use_dora=True), r=4,
                lora_alpha=8)
    ours = LoRALinear(base, 64, 48, 4, 8, 0.0, dora=True)
    ours.reset_lora_parameters()
    ours.init_dora(dequantize_weight(base))
    assert (ours.lora_magnitude - ref.lora_magnitude_vector["default"].weight).abs().max().item() <= 1e-6
    with torch.no_grad():
        ref.lora_A["default"].weight.copy_(torch.randn(4, 64, generator=g) * 0.3)
        ref.lora_B["default"].weight.copy_(torch.randn(48, 4, generator=g) * 0.3)
        ref.lora_magnitude_vector["default"].weight.mul_(1 + 0.2 * torch.randn(48, generator=g))
        ours.lora_A.copy_(ref.lora_A["default"].weight)
        ours.lora_B.copy_(ref.lora_B["default"].weight)
        ours.lora_magnitude.copy_(ref.lora_magnitude_vector["default"].weight)
    x = torch.randn(2, 7, 64, generator=g)
    ya, yb = ours.train()(x), ref.train()(x)
    assert (ya - yb).abs().max().item() <= 1e-5
    w = torch.randn(ya.shape, generator=g)
    (ya * w).sum().backward()
    (yb * w).sum().backward()
    for a, b in [(ours.lora_A.grad, ref.lora_A["default"].weight.grad),
                 (ours.lora_B.grad, ref.lora_B["default"].weight.grad),
                 (ours.lora_magnitude.grad, ref.lora_magnitude_vector["default"].weight.grad)]:
        assert (a - b).abs().max().item() <= 1e-5 * max(1.0, b.abs().max().item())


def test_dora_starts_at_the_base_and_keeps_no_weight_copy(lora_llama):
    """At init (B = 0) the magnitudes are the base's row norms, the model computes the base exactly, and besides
    the 1-D norms nothing of the size of a weight is kept (on a 4-bit base)."""
    idx = random_tokens(2, 8, seed=2)
    base = load_model(lora_llama.folder, precision="32-true", quantize="bnb.nf4")
    lora = replace(lora_cfg(**QV), dora=True)
    model = load_model(lora_llama.folder, precision="32-true", quantize="bnb.nf4", lora=lora, seed=0)
    with torch.no_grad():
        assert (model(idx) - base(idx)).abs().max().item() <= 1e-4
    for m in lora_modules(model).values():
        assert {n: tuple(b.shape) for n, b in m.named_buffers(recurse=False)} == {"lora_wnorm2": (m.out_features,)}
        assert m.lora_magnitude.shape == (m.lora_B.shape[0],)


def _peft_dora_model(tiny, targets, seed=5, r=4, **kw):
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(hf_model(tiny.folder), LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0,
                                                                  use_dora=True, target_modules=targets,
                                                                  task_type="CAUSAL_LM", **kw))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_magnitude" in name:
                p.mul_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return peft_model.eval()


@pytest.mark.parametrize("which,targets,rslora", [
    ("lora_llama", ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False),
    ("lora_llama", ["q_proj", "v_proj"], True), ("lora_neox", ["query_key_value", "dense"], False),
    ("lora_phi3", ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], True)],
    ids=["llama-all", "llama-qv-rslora", "neox-fused", "phi3-fused-gate-up-rslora"])
@torch.no_grad()
def test_dora_adapters_both_ways_with_peft(which, targets, rslora, request, tmp_path):
    """A PEFT DoRA adapter imports and computes PEFT's logits here; exported back, PEFT loads it (use_dora, the
    lora_magnitude_vector keys) with the same logits; the merged weights equal PEFT's merge_and_unload."""
    from peft import PeftModel

    tiny = request.getfixturevalue(which)
    # rank 12: PEFT's x @ A^T then takes the same class of fp32 kernel as ours, whose parts of a fused layer stack
    # their A (3 x 4 = 12 columns); at rank 4 PEFT's narrow product (N = 4) takes a kernel 1.6x more exact than every
    # other fp32 product of either model on an AVX512 EPYC (MKL), which helpers_bounds' rule would charge to us
    peft_model = _peft_dora_model(tiny, targets, r=12, use_rslora=rslora)
    idx = random_tokens(SEQUENCES, 12, seed=6)
    peft_model.save_pretrained(tmp_path / "peft")
    adapter = Adapter.load(tmp_path / "peft", tiny.config)
    assert adapter.config.dora and adapter.config.rslora == rslora
    ours = load_model_with_adapter(tiny.folder, adapter, precision="32-true")
    assert_logits_as_close_as(ours(idx), peft_model, idx, "against PEFT")
    adapter.export_peft(tiny.config, tmp_path / "back")
    again = PeftModel.from_pretrained(hf_model(tiny.folder), tmp_path / "back").eval()
    assert again.peft_config["default"].use_dora
    assert_logits_as_close_as(again(idx).logits, peft_model, idx, "PEFT on the export")
    merged = load_model(tiny.folder, precision="32-true", merge_adapter=adapter)  # Adapter.merged, the one merge rule
    assert_merged_as_close_as(merged(idx), peft_model, idx)


def test_dora_export_refuses_a_partial_fused_qkv(lora_neox, tmp_path):
    lora = replace(lora_cfg(**QV), dora=True)
    model = load_model(lora_neox.folder, precision="32-true", lora=lora, seed=0)
    with pytest.raises(UserError, match="lora_key and --lora_value all true"):
        adapter_of(model, lora).export_peft(lora_neox.config, tmp_path / "peft")


@torch.no_grad()
def test_unmerged_dora_decodes_through_the_kernel_as_peft_on_bitsandbytes(lora_llama, tmp_path):
    """Generation with an unmerged DoRA adapter on nf4: every DoRA layer decodes in one 4-bit kernel call
    (DecodeLoRALinear, the factor per row inside it), and the model computes what transformers + bitsandbytes nf4 +
    PEFT's own DoRA layers compute on the same weights (fp32: logits within 1e-4) through the kernel (up to 16 rows)
    and the dense prefill path alike; greedy tokens equal HF's generate. Red with the factor left out of the kernel
    call or the DoRA layers kept off the kernel (the DecodeLoRALinear count)."""
    from peft import PeftModel

    from lit_qlora.generation import generate
    from lit_qlora.inference import fast_cpu_4bit_decoding
    from lit_qlora.quant.decode4bit import DecodeLoRALinear, kernel

    peft_model = _peft_dora_model(lora_llama, ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"])
    peft_model.save_pretrained(tmp_path / "peft")
    adapter = Adapter.load(tmp_path / "peft", lora_llama.config)
    ref = PeftModel.from_pretrained(hf_4bit(lora_llama.folder, "bnb.nf4"), tmp_path / "peft").eval()
    ours = load_model_with_adapter(lora_llama.folder, adapter, precision="32-true", quantize="bnb.nf4").eval()
    if fast_cpu_4bit_decoding(ours) == 0:
        assert kernel() is None
        pytest.skip("no C compiler for the decode kernel")
    assert sum(isinstance(m, DecodeLoRALinear) for m in ours.modules()) == len(lora_modules(ours)) == 8
    for n in (12, 30):  # 12 rows: through the kernel; 30: dequantized prefill
        idx = random_tokens(1, n, seed=n)
        assert (ours(idx) - ref(idx).logits).abs().max().item() <= 1e-4, n
    prompt = random_tokens(6, seed=9)
    want = ref.generate(prompt[None], max_new_tokens=8, do_sample=False, attention_mask=torch.ones(1, 6, dtype=int))
    assert torch.equal(generate(ours, prompt, 8), want[0])


# ---- pissa / olora / loftq ---------------------------------------------------------------------------------------
def _peft_init_layer(w: torch.Tensor, init, r: int = 4, alpha: float = 8, **kw):
    """PEFT's own LoRA layer over a Linear of weight `w`, initialized its way (`init_lora_weights`)."""
    from peft import LoraConfig
    from peft.tuners.lora import Linear as PeftLoraLinear

    base = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    with torch.no_grad():
        base.weight.copy_(w)
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, init_lora_weights=init, **kw)
    return PeftLoraLinear(base, "default", config, r=r, lora_alpha=alpha, init_lora_weights=init)


def _same_up_to_sign(a: torch.Tensor, b: torch.Tensor, rows: bool, tol: float = 1e-4) -> None:
    """Equal, each singular direction possibly negated (rows of A, the matching columns of B)."""
    a, b = (a, b) if rows else (a.T, b.T)
    sign = torch.sign((a * b).sum(1, keepdim=True))
    assert (a - sign * b).abs().max().item() <= tol * max(1.0, b.abs().max().item())


@pytest.mark.parametrize("init", ["pissa", "olora"])
def test_pissa_and_olora_start_as_peft(init):
    """Ours and PEFT's init on the same weight: the same A and B (up to the sign of each singular direction for
    PiSSA) and the same residual base weight."""
    from lit_qlora.lora import lora_delta, residual_init

    w = torch.randn(40, 24, generator=torch.Generator().manual_seed(0))
    ref = _peft_init_layer(w, init)
    A, B, A0, B0 = residual_init(w, init, 4, 8 / 4)
    assert torch.equal(A, A0) and torch.equal(B, B0)
    _same_up_to_sign(A, ref.lora_A["default"].weight, rows=True)
    _same_up_to_sign(B, ref.lora_B["default"].weight, rows=False)
    residual = w - lora_delta(A0, B0, [(0, 40)], 4, 2.0, 40)
    assert (residual - ref.base_layer.weight).abs().max().item() <= 1e-5


@pytest.mark.parametrize("iters", [1, 3])
def test_loftq_starts_as_peft_and_closer_than_the_4bit_base(iters):
    """LoftQ: PEFT's loftq_init (its own code, with the device it computes on set to the CPU: it names cuda) on the
    same weight gives the same base (the dequantized nf4 of the residual) and the same s*B@A (alpha = r: PEFT's
    factors are for scaling 1); base + adapter is closer to W than the nf4 base of W alone."""
    import types

    import bitsandbytes as bnb
    from peft.utils import loftq_utils

    from lit_qlora.lora import lora_delta, residual_init

    fn = loftq_utils.loftq_init.__wrapped__
    code = fn.__code__.replace(co_consts=tuple("cpu" if c == "cuda" else c for c in fn.__code__.co_consts))
    peft_loftq = types.FunctionType(code, fn.__globals__)
    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(1)) * 0.1

    def quant_error(x):  # nf4 without double quantization, blocks of 64 over the flat weight: PEFT's Params4bit
        q, state = bnb.functional.quantize_4bit(x.contiguous(), blocksize=64, quant_type="nf4")
        return x - bnb.functional.dequantize_4bit(q, state)

    with torch.no_grad():
        ref_base, ref_A, ref_B = peft_loftq(w, num_bits=4, reduced_rank=4, num_iter=iters)
    A, B, A0, B0 = residual_init(w, "loftq", 4, 1.0, iters, quant_error)
    kept = w - lora_delta(A0, B0, [(0, 48)], 4, 1.0, 48)
    base = kept - quant_error(kept)
    assert (base - ref_base).abs().max().item() <= 1e-6
    assert ((B @ A) - (ref_B @ ref_A)).abs().max().item() <= 1e-4
    plain = w - quant_error(w)
    assert (base + B @ A - w).norm() < 0.9 * (plain - w).norm()


@pytest.mark.parametrize("mode", ["bnb.nf4", "bnb.nf4-dq", "bnb.fp4", "bnb.fp4-dq", "bnb.int8"])
@torch.no_grad()
def test_residual_bases_are_bitsandbytes_quantizations_of_the_residual(mode, lora_llama):
    """Every --quantize mode, PiSSA / OLoRA / LoftQ (4-bit only): the base the loader stores is bitsandbytes' own
    layer of W - s*B0@A0 (the residual of the adapter's recorded initial A0, B0; a fused qkv's q and v parts each
    their own, k as it was), to the byte and block scale; for PiSSA and LoftQ on 4 bits, base + s*B@A is closer to
    W than the 4-bit W alone."""
    from helpers import assert_same_stored, reference_layer
    from safetensors.torch import load_file

    from lit_qlora.lora import lora_delta
    from lit_qlora.quant.quantize import dequantize_weight, quantized_parts

    stored = load_file(lora_llama.folder / "lit_model.safetensors")
    for init in ["pissa", "olora"] + (["loftq"] if mode != "bnb.int8" else []):
        lora = replace(lora_cfg(query=True, value=True, mlp=True), init=init, loftq_iters=2)
        model = load_model(lora_llama.folder, precision="32-true", quantize=mode, lora=lora, seed=0)
        for name in ("transformer.h.0.attn.qkv", "transformer.h.1.mlp.fc_2"):
            m, w = lora_modules(model)[name], stored[name + ".weight"].float()
            parts = quantized_parts(lora_llama.config, name)  # q, k, v quantized apart, as transformers does
            residual = w - lora_delta(m.lora_A0, m.lora_B0, m.parts, m.r, m.scaling, m.out_features)
            assert_same_stored(m.base, reference_layer(mode, residual, torch.float32, parts))
            if init != "olora" and mode != "bnb.int8":
                ref = reference_layer(mode, w, torch.float32, parts)
                plain = torch.cat([dequantize_weight(r).float() for r in (ref if parts else [ref])])
                start = dequantize_weight(m.base).float() + m.delta_weight()
                assert (start - w).norm() < (plain - w).norm(), (init, name)


@pytest.mark.parametrize("init,quantize,dora", [("pissa", None, False), ("pissa", "bnb.nf4", False),
                                                ("olora", "bnb.nf4-dq", False), ("loftq", "bnb.nf4", False),
                                                ("olora", None, True)],
                         ids=["pissa", "qpissa-nf4", "olora-nf4-dq", "loftq-nf4", "olora+dora"])
@torch.no_grad()
def test_residual_inits_load_merge_and_export_as_plain_lora(init, quantize, dora, lora_llama, tmp_path):
    """A fresh model with the init computes the unquantized base (nearly: the residual is what gets quantized);
    after training its adapter loads with no flags (the base gives up the recorded s*B0@A0 again), the merge equals
    the unmerged model, and the PEFT export is a plain LoRA of rank 2r over the original base with the same logits
    (with DoRA: PEFT's DoRA layers, the same magnitudes over W + s*B'@A' = the residual + s*B@A)."""
    from peft import PeftModel

    idx = random_tokens(2, 10, seed=4)
    lora = replace(lora_cfg(query=True, value=True, mlp=True), init=init, loftq_iters=2, dora=dora)
    if dora:  # all of the fused qkv: PEFT's DoRA needs every part of a fused layer it adapts; rank 8: PEFT's products
        # (rank 2r = 16) and ours (3 parts' A stacked, 24) take one class of fp32 kernel (see _peft_dora_model's use)
        lora = replace(lora, key=True, r=8, alpha=16)
    dense = load_model(lora_llama.folder, precision="32-true")(idx)
    model = load_model(lora_llama.folder, precision="32-true", quantize=quantize, lora=lora, seed=0)
    start = model(idx)
    if quantize is None:
        assert (start - dense).abs().max().item() <= 1e-4
    elif init != "olora":  # QPiSSA's / LoftQ's purpose: base + adapter closer to the unquantized model than 4 bits
        plain = load_model(lora_llama.folder, precision="32-true", quantize=quantize)(idx)
        assert (start - dense).abs().mean() < (plain - dense).abs().mean()
    randomize_lora(model, seed=8)  # "trained"
    if dora:
        g = torch.Generator().manual_seed(3)
        for m in lora_modules(model).values():
            m.lora_magnitude.mul_(1 + 0.2 * torch.randn(m.lora_magnitude.shape, generator=g))
    trained = model(idx)
    adapter = Adapter.of_model(model, lora, train=dict(quantize=quantize, precision="32-true"))
    adapter.save(tmp_path / "a.pth")
    again = Adapter.load(tmp_path / "a.pth")
    assert again.config == lora
    ours = load_model_with_adapter(lora_llama.folder, again, precision="32-true", quantize=quantize)
    assert (ours(idx) - trained).abs().max().item() <= 1e-5
    if init == "loftq":  # merged: the 4-bit residual it trained on, dequantized, + s*B@A: what the layer computed
        from safetensors.torch import load_file

        from lit_qlora.quant.quantize import dequantize_weight
        stored = load_file(lora_llama.folder / "lit_model.safetensors")
        for name in ("transformer.h.0.attn.qkv", "transformer.h.1.mlp.fc_2"):
            m = lora_modules(model)[name]
            used = dequantize_weight(m.base).float() + m.delta_weight()
            assert (again.merged(name + ".weight", stored[name + ".weight"], torch.float32) - used).abs().max() <= 1e-5
        return  # its export: test_loftq_exports_as_plain_lora_over_the_original_weights
    rows = random_tokens(SEQUENCES, 10, seed=5)
    merged = load_model(lora_llama.folder, precision="32-true", merge_adapter=again)(rows)
    unmerged_dense = load_model_with_adapter(lora_llama.folder, again, precision="32-true")(rows)
    again.export_peft(lora_llama.config, tmp_path / "peft")
    peft_model = PeftModel.from_pretrained(hf_model(lora_llama.folder), tmp_path / "peft").eval()
    assert peft_model.peft_config["default"].r == 2 * lora.r and peft_model.peft_config["default"].use_dora == dora
    assert_logits_as_close_as(unmerged_dense, peft_model, rows, "against PEFT")
    assert_merged_as_close_as(merged, peft_model, rows)


@pytest.mark.parametrize("iters,dora", [(1, True), (2, False)], ids=["1-step+dora", "2-step"])
@torch.no_grad()
def test_loftq_exports_as_plain_lora_over_the_original_weights(iters, dora, lora_llama, tmp_path):
    """A trained LoftQ adapter (its model: Q(W - s*B0@A0) + s*B@A over nf4) exports as a plain LoRA over the
    original W: transformers + PEFT loading the folder on the unmodified model give our logits (unquantized base +
    `as_plain_lora`, fp32, 1e-5), and the same as PEFT running the trained (A, B) and the initial (A0, -B0) as two
    active adapters at once (rank r each: PEFT's subtract_mutated_init arithmetic; one step: A0 = B0 = 0, exported at
    rank r). Its logits are closer to the trained quantized model's than the original base's; `export_gap` is the
    residual's nf4 error, relative, measured against bitsandbytes' own quantization of the residual; export_peft.py
    prints it in one line. Without a recorded --quantize the merge is still refused, the export says it measured
    nothing."""
    from helpers import reference_layer, run_in_process
    from peft import PeftModel
    from safetensors.torch import load_file

    from lit_qlora.lora import lora_delta
    from lit_qlora.quant.quantize import dequantize_weight, quantized_parts

    idx = random_tokens(2, 10, seed=4)
    lora = replace(lora_cfg(query=True, value=True, mlp=True), init="loftq", loftq_iters=iters, dora=dora)
    if dora:  # all of the fused qkv: PEFT's DoRA needs every part of a fused layer it adapts
        lora = replace(lora, key=True)
    model = load_model(lora_llama.folder, precision="32-true", quantize="bnb.nf4", lora=lora, seed=0)
    g = torch.Generator().manual_seed(8)
    for m in lora_modules(model).values():  # "trained": A and B moved off their start (far enough to matter)
        m.lora_A.add_(torch.randn(m.lora_A.shape, generator=g) * 0.05)
        m.lora_B.add_(torch.randn(m.lora_B.shape, generator=g) * 0.05)
        if dora:
            m.lora_magnitude.mul_(1 + 0.1 * torch.randn(m.lora_magnitude.shape, generator=g))
    trained = model(idx)
    adapter = Adapter.of_model(model, lora, train=dict(quantize="bnb.nf4", precision="32-true"))
    adapter.save(tmp_path / "a.pth")
    plain = adapter.as_plain_lora()
    assert plain.config.init == "default" and plain.config.r == (2 * lora.r if iters > 1 else lora.r)
    run = run_in_process("export_peft.py", "--checkpoint_dir", lora_llama.folder, "--lora_path", tmp_path / "a.pth",
                         "--out_dir", tmp_path / "peft")
    assert run.returncode == 0, run.stderr
    exported = PeftModel.from_pretrained(hf_model(lora_llama.folder), tmp_path / "peft").eval()
    assert exported.peft_config["default"].r == plain.config.r and exported.peft_config["default"].use_dora == dora
    got = exported(idx).logits
    rows = random_tokens(SEQUENCES, 10, seed=5)
    assert_logits_as_close_as(load_model_with_adapter(lora_llama.folder, plain, precision="32-true")(rows), exported,
                              rows, "against PEFT")
    if not dora:  # PEFT's own arithmetic: the trained adapter plus the initial one negated, both active
        first = {k: v for k, v in adapter.lora.items() if not k.endswith(("_A0", "_B0"))}
        init = {k.removesuffix("0"): (-v if k.endswith("_B0") else v) for k, v in adapter.lora.items()
                if k.endswith(("_A0", "_B0"))}
        for name, tensors in (("trained", first), ("init", init)):
            Adapter(tensors, replace(lora, init="default"), adapter.model_config).export_peft(
                lora_llama.config, tmp_path / name)
        both = PeftModel.from_pretrained(hf_model(lora_llama.folder), tmp_path / "trained", adapter_name="trained")
        both.load_adapter(tmp_path / "init", adapter_name="init")
        both.base_model.set_adapter(["trained", "init"])
        assert_logits_as_close_as(both.eval()(rows).logits, exported, rows, "PEFT's two adapters")
    base = hf_model(lora_llama.folder)(idx).logits
    to_trained, base_to_trained = (got - trained).abs().mean().item(), (base - trained).abs().mean().item()
    print(f"mean |logits - trained|: exported {to_trained:.5f}, original base {base_to_trained:.5f}")
    assert to_trained < 0.5 * base_to_trained
    stored = load_file(lora_llama.folder / "lit_model.safetensors")
    gaps = adapter.export_gap(stored.items())
    assert set(gaps) == set(adapter.targets())
    for name, m in lora_modules(model).items():  # the residual's own nf4 error, from bitsandbytes
        w = stored[name + ".weight"].float()
        residual = w - lora_delta(m.lora_A0, m.lora_B0, m.parts, m.r, m.scaling, m.out_features)
        parts = quantized_parts(lora_llama.config, name)
        ref = reference_layer("bnb.nf4", residual, torch.float32, parts)
        error = torch.cat([dequantize_weight(r).float() for r in (ref if parts else [ref])]) - residual
        used = adapter.merged(name + ".weight", stored[name + ".weight"], torch.float32)
        assert abs(gaps[name] - float(error.norm() / used.norm())) <= 1e-4 * gaps[name] or dora
        assert 0.01 < gaps[name] < 0.2
    assert "reproduces the trained model up to the quantization error of the residual" in run.stderr
    assert f"over {len(gaps)} layers" in run.stderr and "bnb.nf4" in run.stderr
    unrecorded = replace(adapter, train={})
    with pytest.raises(UserError, match="does not record the --quantize"):
        unrecorded.merged("transformer.h.0.attn.qkv.weight", stored["transformer.h.0.attn.qkv.weight"])
    unrecorded.save(tmp_path / "b.pth")
    run = run_in_process("export_peft.py", "--checkpoint_dir", lora_llama.folder, "--lora_path", tmp_path / "b.pth",
                         "--out_dir", tmp_path / "peft-b")
    assert run.returncode == 0 and "not measured: the adapter does not record its --quantize" in run.stderr


def test_a_run_saved_before_the_variant_fields_resumes():
    """A checkpoint whose settings name a LoRA config without the fields added since (rslora, dora, init, ...) resumes
    under a plain LoRA of the same settings; a different variant is still refused."""
    from dataclasses import asdict

    from lit_qlora.train.training import check_resume_compatible

    old = {k: v for k, v in asdict(LoRAConfig()).items() if k in ("r", "alpha", "dropout", "query", "value")}
    state = {"resume": {"settings": {"lora": old}}}
    check_resume_compatible(state, {"lora": asdict(LoRAConfig())})
    with pytest.raises(UserError, match="the checkpoint was made with lora="):
        check_resume_compatible(state, {"lora": asdict(LoRAConfig(dora=True))})


# ---- the variants through finetune/lora.py: packing, resume, DDP, FSDP --------------------------------------------
VARIANT_RUN = dict(quantize="bnb.nf4-dq", precision="32-true", accelerator="cpu", packing="true", max_seq_length=64,
                   learning_rate=1e-2, min_lr=1e-2, warmup_steps=0, lora_dropout=0.0, lora_mlp="true", batch_size=4,
                   eval_interval=4, eval_iters=1, save_interval=2, keep_checkpoints=0, max_iters=4)


@pytest.mark.parametrize("variant,full", [(dict(lora_dora="true", lora_init="pissa", lora_rslora="true",
                                                loraplus_lr_ratio=4), True),
                                           (dict(lora_dora="true", lora_init="loftq", loftq_iters=2), False)],
                         ids=["dora+pissa+rslora+lora+", "dora+loftq"])
def test_variants_train_packed_on_two_processes_and_resume(variant, full, train_setup, tmp_path):
    """Packed nf4-dq runs of the variants: two DDP processes (micro batch 2) train what one process (micro batch 4)
    trains over the same global batches (losses and every adapter tensor, DoRA's magnitudes and the residual init's
    A0 / B0 included). For the first combination also: a DDP run resumed from its iteration-2 checkpoint retraces it
    (red before the checkpoint check followed LoRA+'s parameter groups: the checkpoint was refused as damaged), and
    FSDP over the two processes follows (the residual and DoRA's norms taken from whole weights before sharding;
    LoftQ under FSDP: tests/test_distributed.py). The adapter records the variant (loads with no flags)."""
    import helpers_train as h

    args = {**VARIANT_RUN, **variant}
    one, two, resumed, sharded = (tmp_path / n for n in ("one", "two", "resumed", "sharded"))
    h.train(train_setup, one, devices=1, micro_batch_size=4, **args)
    h.train(train_setup, two, devices=2, micro_batch_size=2, **args)
    final = "lit_model_lora_finetuned.pth"
    a, b = h.load_lora(one / final), h.load_lora(two / final)
    assert {k.rsplit(".", 1)[1] for k in a} == {"lora_A", "lora_B", "lora_magnitude", "lora_A0", "lora_B0"}
    assert h.max_abs_diff(a, b) < 1e-5
    l1, l2 = h.losses_by_iter(one), h.losses_by_iter(two)
    assert l1.keys() == l2.keys() == {1, 2, 3, 4} and all(abs(l1[i] - l2[i]) < 1e-5 for i in l1), (l1, l2)
    adapter = Adapter.load(one / final)
    assert (adapter.config.dora, adapter.config.init) == (True, variant["lora_init"])
    if not full:
        return
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copy(two / "checkpoints/iter-000002.pth", resumed / "checkpoints/iter-000002.pth")
    r = h.train(train_setup, resumed, devices=2, micro_batch_size=2, resume="true", **args)
    assert "at iteration 2" in r.stderr
    assert h.max_abs_diff(b, h.load_lora(resumed / final)) < 1e-6
    l3 = h.losses_by_iter(resumed)
    assert all(abs(l3[i] - l2[i]) < 1e-6 for i in (3, 4)), (l2, l3)
    h.train(train_setup, sharded, devices=2, micro_batch_size=2, strategy="fsdp", **args)
    l4 = h.losses_by_iter(sharded)
    assert all(abs(l4[i] - l1[i]) <= 1e-4 * abs(l1[i]) for i in l1), (l1, l4)
    assert h.max_abs_diff(a, h.load_lora(sharded / final)) < 1e-4
