"""Mixtures of experts (Qwen3-MoE, Mixtral, gpt-oss as transformers saves it; its MXFP4 files: test_gptoss.py)
beyond the per-family parity tests that their rows in tests/helpers.py TINY_HF_CONFIGS run (logits, gradients, KV
cache, greedy tokens, conversion both ways): experts quantized under every --quantize mode as bitsandbytes quantizes
each expert's weight, only the experts that receive tokens computed, LoRA on attention, experts and router (against
transformers + PEFT's target_parameters, merged, quantized, packed), the routers' load-balancing loss against
transformers' aux_loss, and a QLoRA run from the CLI."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from helpers import assert_same_stored, converted_tiny, random_tokens, reference_layer
from helpers_bounds import SEQUENCES, assert_logits_as_close_as, assert_merged_as_close_as

from lit_qlora.loader import load_model
from lit_qlora.model import MoE
from lit_qlora.quant.quantize import QuantizedExpertWeights, dequantize_weight, validation_mode

MODES = ["bnb.nf4", "bnb.nf4-dq", "bnb.fp4", "bnb.fp4-dq", "bnb.int8"]


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral", "gpt_oss"])
def moe_ckpt(request, tmp_path_factory):
    return converted_tiny(tmp_path_factory, request.param, f"tiny-{request.param}")


@pytest.mark.parametrize("mode", MODES)
@torch.no_grad()
def test_experts_are_quantized_as_bitsandbytes_quantizes_each_expert(moe_ckpt, mode):
    """Every expert's [out, in] of every projection holds what bitsandbytes' own layer stores for that weight (the
    packed codes, block scales and their double quantization, or the int8 rows and row scales); the router stays a
    dense Linear with the checkpoint's weights. The quantized model computes what our dense model computes with
    bitsandbytes' dequantization of those weights (int8 in its dequantizing matmul, `validation_mode`). (The reference
    is bitsandbytes' layer per expert: transformers 5.24's BitsAndBytesConfig leaves these models' stacked experts
    dense, quantizing only their Linear layers, so it has no quantized experts to compare with.)"""
    dense = load_model(moe_ckpt.folder, precision="32-true").eval()
    quantized = load_model(moe_ckpt.folder, precision="32-true", quantize=mode)
    validation_mode(quantized)  # eval, with int8's dequantize-then-matmul (LLM.int8 inference rounds the inputs too)
    n = 0
    for name, q in quantized.named_modules():
        if ".layers." in name or name.endswith(".layers"):  # (inside a QuantizedExpertWeights: below)
            continue
        d = dense.get_submodule(name)
        if isinstance(q, MoE):
            assert type(q.router) is nn.Linear and torch.equal(q.router.weight, d.router.weight)
        elif isinstance(q, QuantizedExpertWeights):
            for e, layer in enumerate(q.layers):
                assert_same_stored(layer, reference_layer(mode, d.weight[e], torch.float32))
                d.weight[e] = dequantize_weight(layer)
                n += 1
        elif type(d) is nn.Linear and type(q) is not nn.Linear:  # the attention's and dense MLPs' quantized layers
            d.weight.copy_(dequantize_weight(q))
    c = moe_ckpt.config
    assert n == c.moe_n_expert * 3 * sum(map(c.is_moe_layer, range(c.n_layer)))
    idx = random_tokens(2, 16, seed=3)
    want = dense(idx)
    assert (quantized(idx) - want).abs().max().item() <= 1e-4 * want.std().item()


@pytest.mark.parametrize("mode", ["bnb.nf4", "bnb.int8"])
@torch.no_grad()
def test_only_the_experts_that_receive_tokens_run(moe_ckpt, mode, monkeypatch):
    """One token through a quantized MoE model: in each MoE layer exactly top_k experts run their three projections,
    each once (the others are never dequantized); a longer sequence runs each active expert once, not per token."""
    model = load_model(moe_ckpt.folder, precision="32-true", quantize=mode).eval()
    calls: list[tuple[str, int]] = []
    for name, m in model.named_modules():
        if isinstance(m, QuantizedExpertWeights):
            for e, layer in enumerate(m.layers):
                real = layer.forward
                monkeypatch.setattr(layer, "forward", lambda x, _n=name, _e=e, _f=real: calls.append((_n, _e)) or _f(x))
    k, moe_layers = moe_ckpt.config.moe_top_k, sum(map(moe_ckpt.config.is_moe_layer, range(moe_ckpt.config.n_layer)))
    model(random_tokens(1, 1, seed=1))
    assert len(calls) == len(set(calls)) == 3 * k * moe_layers
    calls.clear()
    model(random_tokens(1, 24, seed=1))
    assert len(calls) == len(set(calls)) <= 3 * moe_ckpt.config.moe_n_expert * moe_layers


ATTENTION_AND_HEAD = dict(query=True, key=True, value=True, projection=True, head=True)


@torch.no_grad()
def test_attention_lora_exports_to_peft_and_merges_into_an_hf_folder(moe_ckpt, tmp_path):
    """A LoRA on attention and head of a MoE model: PEFT loads our export over transformers' model with the same
    logits, and the merged HF export, loaded by transformers alone, computes what model + adapter computes."""
    from helpers import adapter_of, hf_model, lora_cfg, randomize_lora
    from peft import PeftModel

    from lit_qlora.export.merge import export_hf

    lora = lora_cfg(**ATTENTION_AND_HEAD)
    model = load_model(moe_ckpt.folder, precision="32-true", lora=lora, seed=0).eval()
    randomize_lora(model, seed=4)
    idx = random_tokens(SEQUENCES, 12, seed=3)
    expected = model(idx)
    adapter = adapter_of(model, lora)
    adapter.export_peft(model.config, tmp_path / "peft", base_model_name_or_path=str(moe_ckpt.folder))
    peft_model = PeftModel.from_pretrained(hf_model(moe_ckpt.folder), tmp_path / "peft").eval()
    assert_logits_as_close_as(expected, peft_model, idx, "against PEFT")
    out = export_hf(moe_ckpt.folder, tmp_path / "hf", adapter)
    assert_merged_as_close_as(hf_model(out)(idx).logits, peft_model, idx)


EXPERTS_AND_ROUTER = dict(query=True, value=True, experts=True, router=True)


def _peft_params(config, roles=("gate_up", "down", "router")) -> list[str]:
    """transformers' names of the family's stacked experts / router (PEFT's target_parameters)."""
    from lit_qlora.convert import family

    return [family(config)["moe_params"][r] for r in roles]


def _trained_like(folder, lora, seed: int = 5, **kw):
    """Our fp32 model with random (non-zero) LoRA weights on `lora`'s targets."""
    from helpers import randomize_lora

    model = load_model(folder, precision="32-true", lora=lora, seed=0, **kw)
    randomize_lora(model, seed=seed)
    return model


@torch.no_grad()
def test_expert_and_router_lora_export_to_peft_and_come_back(moe_ckpt, tmp_path):
    """LoRA on experts and router (and q, v): transformers + PEFT loads our export through target_parameters, one
    ParamWrapper on each expert stack and router, and computes our logits (tests/helpers_bounds.py; they differ from the
    base model's); imported back, the adapter is the same settings and tensors; merged into the full-precision
    weights and exported as a transformers folder, transformers alone computes them too."""
    import json

    from helpers import adapter_of, hf_model, lora_cfg
    from peft import PeftModel
    from peft.tuners.lora import ParamWrapper

    from lit_qlora.adapter import Adapter

    lora = lora_cfg(**EXPERTS_AND_ROUTER)
    model = _trained_like(moe_ckpt.folder, lora).eval()
    idx = random_tokens(SEQUENCES, 12, seed=3)
    expected = model(idx)
    assert (expected - hf_model(moe_ckpt.folder)(idx).logits).abs().max() > 0.05
    adapter = adapter_of(model, lora)
    adapter.export_peft(model.config, tmp_path / "peft", base_model_name_or_path=str(moe_ckpt.folder))
    cfg = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert cfg["target_parameters"] == _peft_params(moe_ckpt.config) and cfg["lora_dropout"] == 0.0
    peft_model = PeftModel.from_pretrained(hf_model(moe_ckpt.folder), tmp_path / "peft").eval()
    wrapped = [m.parameter_name for m in peft_model.modules() if isinstance(m, ParamWrapper)]
    moe_layers = sum(map(moe_ckpt.config.is_moe_layer, range(moe_ckpt.config.n_layer)))
    assert sorted(wrapped) == sorted(["gate_up_proj", "down_proj", "weight"] * moe_layers)
    assert_logits_as_close_as(expected, peft_model, idx, "against PEFT")
    back = Adapter.load(tmp_path / "peft", model.config)
    assert back.config == lora and back.lora.keys() == adapter.lora.keys()
    for k, v in adapter.lora.items():
        assert torch.equal(back.lora[k], v), k
    from lit_qlora.export.merge import export_hf

    merged = hf_model(export_hf(moe_ckpt.folder, tmp_path / "hf", adapter))
    assert_merged_as_close_as(merged(idx).logits, peft_model, idx)


@pytest.mark.parametrize("roles", [("gate_up", "down", "router"), ("down",)])
@torch.no_grad()
def test_a_peft_expert_lora_loads_with_peft_s_logits(moe_ckpt, tmp_path, roles):
    """A LoRA made by PEFT itself (get_peft_model with target_parameters, rank 3 with random A and B; gate_up_proj
    one pair per expert shared by gate and up) gives our model transformers + PEFT's logits (helpers_bounds.py); with
    only down_proj targeted, our fc_1 and fc_2 pairs stay inert."""
    from helpers import hf_model
    from peft import LoraConfig, get_peft_model

    from lit_qlora.adapter import Adapter

    params = _peft_params(moe_ckpt.config, roles)
    if roles == ("down",):
        params = [params[0].rpartition(".")[2]]  # as PEFT matches it: a suffix of the parameter's name
    cfg = LoraConfig(r=3, lora_alpha=5, lora_dropout=0.0, target_modules=["q_proj", "o_proj"],
                     target_parameters=params, init_lora_weights=False)
    torch.manual_seed(0)
    peft_model = get_peft_model(hf_model(moe_ckpt.folder), cfg).eval()
    peft_model.save_pretrained(tmp_path / "made")
    idx = random_tokens(SEQUENCES, 12, seed=4)
    adapter = Adapter.load(tmp_path / "made", moe_ckpt.config)
    assert adapter.config.experts and adapter.config.router == ("router" in roles)
    model = load_model(moe_ckpt.folder, precision="32-true", lora=adapter.config).eval()
    adapter.load_into(model)
    assert_logits_as_close_as(model(idx), peft_model, idx, "against PEFT")
    if roles == ("down",):
        assert all(not v.any() for k, v in adapter.lora.items() if ".fc_1." in k or ".fc_2." in k)


def _peft_grads_as_ours(peft_model, config) -> dict[str, torch.Tensor]:
    """The gradients of PEFT's expert and router LoRAs in our layout (gate_up's block-diagonal pairs split into fc_1
    and fc_2: the blocks our LoRAs have)."""
    from lit_qlora.convert import family
    from lit_qlora.export.peft_interop import _our_experts

    grads = {n.replace(".default", ""): p.grad for n, p in peft_model.named_parameters() if p.grad is not None}
    E, inner, r = config.moe_n_expert, config.moe_intermediate_size, 4
    names = family(config)["moe_params"]
    router = names["router"].rpartition(".")[0]  # mlp.gate (Qwen3-MoE, Mixtral), mlp.router (gpt-oss)
    out = {}
    for i in filter(config.is_moe_layer, range(config.n_layer)):
        pre, ours = f"base_model.model.model.layers.{i}.", f"transformer.h.{i}.mlp."
        out[ours + "router.lora_A"], out[ours + "router.lora_B"] = (grads[f"{pre}{router}.lora_{ab}.weight"]
                                                                    for ab in "AB")
        A, B = _our_experts(grads[pre + "mlp.experts.lora_A.weight"], grads[pre + "mlp.experts.lora_B.weight"], E)
        out[ours + "experts.proj.lora_A"], out[ours + "experts.proj.lora_B"] = A, B
        A, B = _our_experts(grads[pre + "mlp.experts.base_layer.lora_A.weight"],
                            grads[pre + "mlp.experts.base_layer.lora_B.weight"], E)
        if names.get("interleaved"):  # gpt-oss: gate and up rows alternate
            B = torch.cat([B[:, 0::2], B[:, 1::2]], 1)
        out[ours + "experts.fc_1.lora_A"], out[ours + "experts.fc_1.lora_B"] = A[:, :r], B[:, :inner, :r]
        out[ours + "experts.fc_2.lora_A"], out[ours + "experts.fc_2.lora_B"] = A[:, r:], B[:, inner:, r:]
    return out


def test_expert_and_router_lora_gradients_equal_peft_s(moe_ckpt, tmp_path):
    """Training: the gradients of every expert's and the router's LoRA pair on the summed cross entropy equal the
    ones transformers + PEFT computes with the exported adapter, within 1e-5 in fp32 (experts that got no token: zero
    in both)."""
    from helpers import adapter_of, hf_model, lora_cfg
    from peft import PeftModel

    lora = lora_cfg(experts=True, router=True)
    model = _trained_like(moe_ckpt.folder, lora, seed=7).train()
    idx = random_tokens(2, 12, seed=5)
    ce = torch.nn.functional.cross_entropy
    ce(model(idx)[:, :-1].flatten(0, 1), idx[:, 1:].flatten(), reduction="sum").backward()
    adapter_of(model, lora).export_peft(model.config, tmp_path / "peft")
    peft_model = PeftModel.from_pretrained(hf_model(moe_ckpt.folder), tmp_path / "peft", is_trainable=True).train()
    ce(peft_model(idx).logits[:, :-1].flatten(0, 1), idx[:, 1:].flatten(), reduction="sum").backward()
    want = _peft_grads_as_ours(peft_model, moe_ckpt.config)
    ours = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert ours.keys() == want.keys()
    for name, g in want.items():
        assert ours[name].abs().max() > 0, name
        torch.testing.assert_close(ours[name], g, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("mode", MODES)
def test_expert_lora_over_every_quantize_mode(moe_ckpt, mode):
    """Expert and router LoRA over quantized experts: the model computes what our dense model of bitsandbytes'
    dequantized weights computes with the same LoRA, gradients reach every pair whose experts got tokens, and a merged
    load stores each expert's W_e + s*B_e@A_e quantized as bitsandbytes quantizes that weight (merged before
    quantizing; the router's merged weight stays dense)."""
    from helpers import adapter_of, lora_cfg

    lora = lora_cfg(**EXPERTS_AND_ROUTER)
    quantized = _trained_like(moe_ckpt.folder, lora, quantize=mode)
    assert all(type(m.router.base) is nn.Linear for m in quantized.modules() if isinstance(m, MoE))  # dense
    adapter = adapter_of(quantized, lora)
    dense = load_model(moe_ckpt.folder, precision="32-true", lora=lora)
    adapter.load_into(dense)
    originals = {n: m.weight.detach().clone() for n, m in load_model(moe_ckpt.folder, precision="32-true")
                 .named_modules() if type(m).__name__ == "ExpertWeights" or n.endswith("mlp.router")}
    with torch.no_grad():
        for name, q in quantized.named_modules():
            if ".layers." in name or name.endswith(".layers"):  # (inside a QuantizedExpertWeights: below)
                continue
            d = dense.get_submodule(name)
            if isinstance(q, QuantizedExpertWeights):
                for e, layer in enumerate(q.layers):
                    d.weight[e] = dequantize_weight(layer)
            elif type(d) is nn.Linear and type(q) is not nn.Linear:  # attention's quantized layers
                d.weight.copy_(dequantize_weight(q))
    validation_mode(quantized)
    dense.eval()
    idx = random_tokens(2, 16, seed=3)
    with torch.no_grad():
        want = dense(idx)
        assert (quantized(idx) - want).abs().max().item() <= 1e-4 * want.std().item()
    quantized.train()
    quantized(idx).float().pow(2).mean().backward()
    for name, p in quantized.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and torch.isfinite(p.grad).all(), name
            if "experts" in name:  # every expert that ran has a gradient, the others none
                ran = p.grad.flatten(1).abs().sum(1) > 0
                assert ran.sum() >= moe_ckpt.config.moe_top_k, name
    merged = load_model(moe_ckpt.folder, precision="32-true", quantize=mode, merge_adapter=adapter)
    s = lora.alpha / lora.r
    for name, w in originals.items():
        m = merged.get_submodule(name)
        A, B = adapter.lora[name + ".lora_A"], adapter.lora[name + ".lora_B"]
        if name.endswith("router"):
            assert type(m) is nn.Linear and torch.allclose(m.weight, w + (B @ A) * s)
            continue
        for e, layer in enumerate(m.layers):
            assert_same_stored(layer, reference_layer(mode, w[e] + (B[e] @ A[e]) * s, torch.float32))


@pytest.mark.parametrize("layout", ["rows", "padded", "packed"])
def test_router_aux_loss_and_its_gradients_equal_transformers(moe_ckpt, layout):
    """Our load-balancing loss equals transformers' aux_loss (output_router_logits=True) on the same batch within 1e-6
    in fp32, and so do its gradients in the router weights: full rows; right-padded rows (transformers with the
    attention mask, ours on `unpad`'s single row of the real tokens, as training runs); rows of packed samples with
    padding (segment -1, not counted). The expert load is transformers' routers' top-k choices counted per layer."""
    from helpers import hf_model

    from lit_qlora.data.batching import collate, collate_packed, unpad

    hf = hf_model(moe_ckpt.folder)
    ours = load_model(moe_ckpt.folder, precision="32-true").eval()
    lengths = [14, 9, 3] if layout != "rows" else [14, 14, 14]
    samples = [{"input_ids": random_tokens(n, seed=60 + i), "labels": random_tokens(n, seed=60 + i)}
               for i, n in enumerate(lengths)]
    batch = collate(samples)
    mask = (torch.arange(14)[None] < batch["lengths"][:, None]).long()
    for p in [*hf.parameters(), *ours.parameters()]:
        p.requires_grad_(False)
    routers = {i: (getattr(hf.model.layers[i].mlp, "gate", None) or hf.model.layers[i].mlp.router).weight
               for i in range(moe_ckpt.config.n_layer) if moe_ckpt.config.is_moe_layer(i)}  # (gpt-oss: router)
    routers = {i: (w, ours.transformer.h[i].mlp.router.weight) for i, w in routers.items()}
    for a, b in routers.values():
        a.requires_grad_(True)
        b.requires_grad_(True)
    out = hf(batch["input_ids"], attention_mask=None if layout == "rows" else mask, output_router_logits=True)
    out.aux_loss.backward()
    if layout == "rows":
        mine = batch
    elif layout == "padded":
        mine, _ = unpad(batch, batch["labels"])
    else:
        mine = collate_packed([samples[:1], samples[1:]])
        assert mine["segments"].eq(-1).any()
    extra = {k: mine[k] for k in ("positions", "segments") if k in mine}
    _, aux, load = ours(mine["input_ids"], router_aux=True, **extra)
    aux.backward()
    torch.testing.assert_close(aux, out.aux_loss, atol=1e-6, rtol=1e-6)
    for i, (a, b) in routers.items():
        assert a.grad.abs().max() > 0
        torch.testing.assert_close(b.grad, a.grad, atol=1e-6, rtol=1e-5)
    keep = mask.reshape(-1).bool()
    k, E = moe_ckpt.config.moe_top_k, moe_ckpt.config.moe_n_expert
    want = [torch.bincount(logits[keep].topk(k).indices.reshape(-1), minlength=E).float()
            for logits in out.router_logits]
    assert torch.equal(load, torch.stack(want))


def test_activation_checkpointing_keeps_the_aux_loss_and_its_gradients(moe_ckpt):
    """With each block recomputed in backward, the load-balancing loss and the LoRA gradients of loss + aux loss are
    those of the plain forward (the recomputation does not record the routing again)."""
    from helpers import lora_cfg

    model = _trained_like(moe_ckpt.folder, lora_cfg(**EXPERTS_AND_ROUTER), seed=4).train()
    idx = random_tokens(2, 12, seed=6)

    def run():
        logits, aux, _ = model(idx, router_aux=True)
        (logits.pow(2).mean() + aux).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        model.zero_grad(set_to_none=True)
        return aux.detach(), grads

    aux, plain = run()
    model.activation_checkpointing = True
    aux_ckpt, checkpointed = run()
    assert torch.equal(aux_ckpt, aux) and all(m.routing is None for m in model.modules() if isinstance(m, MoE))
    for name, g in plain.items():
        torch.testing.assert_close(checkpointed[name], g, atol=1e-6, rtol=1e-5)


def test_packed_samples_with_expert_lora_train_exactly_as_alone(moe_ckpt):
    """Samples packed into rows (with padding): each token's loss equals its loss when its sample runs alone
    (within 1e-5 in fp32), and the gradients of every LoRA pair (q, v, experts, router) of the summed loss plus the
    load-balancing loss equal those of the same samples right-padded and unpadded, as training runs them."""
    from helpers import lora_cfg

    from lit_qlora.data.batching import collate, collate_packed, unpad
    from lit_qlora.train.training import shift_labels

    model = _trained_like(moe_ckpt.folder, lora_cfg(**EXPERTS_AND_ROUTER), seed=2).train()
    lengths = [13, 20, 9, 11]
    samples = [{"input_ids": random_tokens(n, seed=20 + i), "labels": random_tokens(n, seed=20 + i)}
               for i, n in enumerate(lengths)]
    packed = collate_packed([samples[:3], samples[3:]])

    def token_losses(logits, labels):
        return torch.nn.functional.cross_entropy(logits, shift_labels(labels[None])[0], reduction="none")

    with torch.no_grad():
        logits = model(packed["input_ids"], positions=packed["positions"], segments=packed["segments"])
        for (r, at), s in zip([(0, 0), (0, 13), (0, 33), (1, 0)], samples):
            n = len(s["input_ids"])  # (its last token predicts nothing, alone or packed)
            got = token_losses(logits[r], packed["labels"][r])[at:at + n - 1]
            want = token_losses(model(s["input_ids"][None])[0], s["labels"])[:n - 1]
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)

    def grads(b, tgt):
        extra = {k: b[k] for k in ("positions", "segments") if k in b}
        logits, aux, _ = model(b["input_ids"], router_aux=True, **extra)
        (torch.nn.functional.cross_entropy(logits.flatten(0, 1), tgt.flatten(), reduction="sum") + aux).backward()
        out = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        model.zero_grad(set_to_none=True)
        return out

    padded = collate(samples)
    want = grads(*unpad(padded, shift_labels(padded["labels"])))
    for name, g in grads(packed, shift_labels(packed["labels"])).items():
        assert want[name].abs().max() > 0, name
        torch.testing.assert_close(g, want[name], atol=1e-5, rtol=1e-4)


def test_the_training_step_adds_the_aux_loss_as_transformers_computes_it(moe_ckpt, tmp_path, monkeypatch):
    """finetune/lora.py's step over two accumulated micro batches (padded, as collated; the step unpads them): its
    expert and router LoRA gradients equal, within 1e-5 in fp32, those transformers + PEFT (with the exported
    adapter) give the same objective built from its outputs: the cross entropy summed over the step's target tokens
    and divided by their number, plus --router_aux_loss_coef times the mean of the micro batches' aux_loss (each
    with its attention mask). The aux_loss it logs is that mean."""
    import importlib.util
    import json
    import sys

    import lightning as L
    from helpers import hf_model, randomize_lora
    from helpers_tokenizer import make_hf_bpe_tokenizer
    from helpers_train import FINETUNE, VOCAB, make_records
    from lightning.fabric.plugins.precision import Precision
    from peft import PeftModel

    from lit_qlora.adapter import Adapter
    from lit_qlora.args import parse_finetune_args
    from lit_qlora.data.batching import collate
    from lit_qlora.train.training import shift_labels, unlock_out_dir

    make_hf_bpe_tokenizer(moe_ckpt.folder, vocab_size=VOCAB)
    data, out, coef = tmp_path / "data", tmp_path / "out", 0.5
    data.mkdir()
    (data / "tasks.json").write_text(json.dumps(make_records()))
    spec = importlib.util.spec_from_file_location("finetune_lora", FINETUNE)
    sft = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, sft)  # (its dataclasses look their module up)
    spec.loader.exec_module(sft)
    args = parse_finetune_args(["--checkpoint_dir", str(moe_ckpt.folder), "--data_dir", str(data), "--out_dir",
                                str(out), "--micro_batch_size", "2", "--batch_size", "4", "--lora_r", "4",
                                "--lora_query", "false", "--lora_value", "false", "--lora_experts", "true",
                                "--lora_router", "true", "--lora_dropout", "0", "--precision", "32-true",
                                "--template", "plain", "--router_aux_loss_coef", str(coef)])
    try:
        inputs = sft.check_inputs(args)
        s = sft.build_model(L.Fabric(accelerator="cpu", devices=1, plugins=[Precision()]), args, inputs)
    finally:
        unlock_out_dir(out)
    randomize_lora(s.gpt, seed=9)
    micro = [collate(inputs.train_data[i:i + 2]) for i in (0, 2)]
    s.stream = iter(micro)
    _, _, extra = sft.sft_accumulate(s)
    ours = {n: p.grad for n, p in s.gpt.named_parameters() if p.requires_grad}

    Adapter.of_model(s.gpt, inputs.lora).export_peft(moe_ckpt.config, tmp_path / "peft")
    peft_model = PeftModel.from_pretrained(hf_model(moe_ckpt.folder), tmp_path / "peft", is_trainable=True).train()
    targets = [shift_labels(b["labels"]) for b in micro]
    n_tok = sum(int(t.ne(-100).sum()) for t in targets)
    objective, aux = 0.0, []
    for b, tgt in zip(micro, targets):
        mask = (torch.arange(b["input_ids"].shape[1])[None] < b["lengths"][:, None]).long()
        o = peft_model(b["input_ids"], attention_mask=mask, output_router_logits=True)
        ce = torch.nn.functional.cross_entropy(o.logits.flatten(0, 1), tgt.flatten(), reduction="sum")
        objective = objective + ce / n_tok + coef * o.aux_loss / len(micro)
        aux.append(o.aux_loss.item())
    objective.backward()
    assert abs(extra["aux_loss"] - sum(aux) / len(aux)) <= 1e-6
    want = _peft_grads_as_ours(peft_model, moe_ckpt.config)
    assert ours.keys() == want.keys()
    for name, g in want.items():
        torch.testing.assert_close(ours[name], g, atol=1e-5, rtol=1e-4)


def test_an_expert_adapter_is_served_beside_others(moe_ckpt):
    """The server's adapter bank puts an expert and router LoRA in place over the shared 4-bit base: the logits of
    the model loaded with that adapter (unmerged), and the bare base's again when it is taken out."""
    from helpers import adapter_of, lora_cfg

    from lit_qlora.engine.adapters import AdapterBank
    from lit_qlora.loader import load_model_with_adapter

    lora = lora_cfg(**EXPERTS_AND_ROUTER)
    adapter = adapter_of(_trained_like(moe_ckpt.folder, lora), lora)
    base = load_model(moe_ckpt.folder, precision="32-true", quantize="bnb.nf4").eval()
    idx = random_tokens(1, 10, seed=8)
    with torch.no_grad():
        bare = base(idx)
        want = load_model_with_adapter(moe_ckpt.folder, adapter, precision="32-true", quantize="bnb.nf4").eval()(idx)
        bank = AdapterBank(base, "32-true")
        bank.add("moe", adapter)
        bank.activate("moe")
        assert (base(idx) - want).abs().max().item() <= 1e-5 and (want - bare).abs().max() > 0.05
        bank.activate(None)
        assert torch.equal(base(idx), bare)


def test_what_lora_on_a_mixture_does_not_implement_is_refused_in_one_line(moe_ckpt, tmp_path, monkeypatch):
    """--lora_mlp on a MoE model (its MLPs are experts), --lora_experts / --lora_router on a dense model, DoRA or a
    residual init on experts and router, a PEFT export for an architecture whose expert layout is not mapped, and a
    PEFT folder naming a parameter we do not map: each one line naming it."""
    import json

    from helpers import adapter_of, lora_cfg
    from safetensors.torch import save_file

    from lit_qlora.adapter import Adapter
    from lit_qlora.config import Config
    from lit_qlora.export import peft_interop
    from lit_qlora.lora import LoRAConfig, lora_targets
    from lit_qlora.utils import UserError

    with pytest.raises(UserError, match="--lora_mlp on a mixture of experts: .* --lora_experts true"):
        load_model(moe_ckpt.folder, precision="32-true", lora=lora_cfg(mlp=True))
    dense = Config(name="dense", n_layer=2, n_head=4, n_embd=64, vocab_size=320)
    for flag in ("experts", "router"):
        with pytest.raises(UserError, match=f"--lora_{flag} adapts a mixture of experts, which dense is not"):
            lora_targets(dense, LoRAConfig(**{flag: True}))
    with pytest.raises(UserError, match="--lora_dora on the experts"):
        lora_targets(moe_ckpt.config, LoRAConfig(experts=True, dora=True))
    with pytest.raises(UserError, match="--lora_init pissa on the router"):
        lora_targets(moe_ckpt.config, LoRAConfig(router=True, init="pissa"))

    lora = lora_cfg(**EXPERTS_AND_ROUTER)
    adapter = adapter_of(load_model(moe_ckpt.folder, precision="32-true", lora=lora), lora)
    real = peft_interop.family
    monkeypatch.setattr(peft_interop, "family", lambda c: {**real(c), "moe_params": None})
    with pytest.raises(UserError, match=f"PEFT interop of LoRA on the experts or the router of "
                                        f"{moe_ckpt.config.hf_architecture} is not implemented"):
        adapter.export_peft(moe_ckpt.config, tmp_path / "peft")
    assert not (tmp_path / "peft").exists()
    monkeypatch.undo()

    adapter.export_peft(moe_ckpt.config, tmp_path / "peft")
    cfg_path = tmp_path / "peft" / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    params = _peft_params(moe_ckpt.config)
    cfg_path.write_text(json.dumps({**cfg, "target_parameters": [*params, "mlp.experts.gate_up_proj_bias"]}))
    with pytest.raises(UserError, match="targets the parameter 'mlp.experts.gate_up_proj_bias'; lit-qlora maps only"):
        Adapter.load(tmp_path / "peft", moe_ckpt.config)
    cfg_path.write_text(json.dumps(cfg))
    weights = tmp_path / "peft" / "adapter_model.safetensors"
    from safetensors.torch import load_file

    router = params[2].rpartition(".")[0]
    save_file({k: v for k, v in load_file(weights).items() if f".{router}." not in k}, weights)
    with pytest.raises(UserError, match=f"lists {params[2]} in target_parameters but holds no LoRA weights"):
        Adapter.load(tmp_path / "peft", moe_ckpt.config)


def test_qlora_on_a_moe_model_trains_from_the_cli_resumes_and_generates(tmp_path):
    """The user's path on Qwen3-MoE, as subprocesses: finetune/lora.py --quantize bnb.nf4-dq --lora_experts true
    --lora_router true learns (the loss falls), logs the load-balancing loss and the expert load, resumes from its
    iteration-4 checkpoint to the same losses and adapter as the uninterrupted run, and generate/lora.py answers with
    the adapter (which records its expert and router LoRA: no flags) merged and with --merge false."""
    import json
    import math

    from helpers import make_tiny_hf_model
    from helpers_tokenizer import make_hf_bpe_tokenizer
    from helpers_train import GENERATE_LORA, VOCAB, load_lora, make_records, max_abs_diff, read_metrics, run_script
    from helpers_train import train as train_cli

    ckpt = tmp_path / "qwen3_moe"
    make_tiny_hf_model("qwen3_moe", ckpt, initializer_range=0.2, vocab_size=VOCAB)
    make_hf_bpe_tokenizer(ckpt, vocab_size=VOCAB)
    data = tmp_path / "data"
    data.mkdir()
    (data / "tasks.json").write_text(json.dumps(make_records()))
    setup = {"ckpt": ckpt, "data": data}
    flags = dict(quantize="bnb.nf4-dq", lora_experts="true", lora_router="true", learning_rate=1e-2, save_interval=4,
                 eval_iters=0)
    out = tmp_path / "out"
    train_cli(setup, out, max_iters=8, **flags)
    rows = read_metrics(out)
    losses = [float(r["loss"]) for r in rows]
    assert len(losses) == 8 and all(map(math.isfinite, losses)) and sum(losses[-4:]) / 4 < 0.9 * losses[0]
    aux = [float(r["aux_loss"]) for r in rows]  # k = 2 for even routing, at most E = 4
    assert all(1.9 < a < 4 for a in aux) and all(0.5 <= float(r["expert_load_max"]) <= 1 for r in rows)
    summary = json.loads((out / "metrics.json").read_text())
    load = summary["expert_load"]
    assert load["layers"] == [0, 2] and load["even_share"] == 0.5  # mlp_only_layers=[1]
    for shares in (load["all_steps"], load["last_step"]):
        assert len(shares) == 2 and all(len(row) == 4 and math.isclose(sum(row), 2, rel_tol=1e-4) for row in shares)
    hp = json.loads((out / "hyperparameters.json").read_text())
    # output_router_logits false in the tiny config: no aux loss added by default (still logged)
    assert hp["resolved"]["router_aux_loss_coef"] == 0.0 and hp["lora"]["experts"] and hp["lora"]["router"]

    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    (resumed / "checkpoints" / "iter-000004.pth").write_bytes((out / "checkpoints" / "iter-000004.pth").read_bytes())
    train_cli(setup, resumed, max_iters=8, resume="true", **flags)
    again = {int(r["iter"]): float(r["loss"]) for r in read_metrics(resumed)}
    assert sorted(again) == [5, 6, 7, 8] and all(abs(again[i] - losses[i - 1]) <= 1e-6 for i in again)
    assert max_abs_diff(load_lora(resumed / "lit_model_lora_finetuned.pth"),
                        load_lora(out / "lit_model_lora_finetuned.pth")) < 1e-6
    assert json.loads((resumed / "metrics.json").read_text())["expert_load"] == load  # counts kept in checkpoints

    for merge in ("true", "false"):
        r = run_script(GENERATE_LORA, ["--checkpoint_dir", ckpt, "--lora_path", out / "lit_model_lora_finetuned.pth",
                                       "--quantize", "bnb.nf4-dq", "--precision", "32-true", "--prompt", "kind",
                                       "--max_new_tokens", "4", "--merge", merge, "--temperature", "0"])
        assert r.returncode == 0, r.stderr


def test_a_checkpoint_of_stacked_experts_is_refused_in_one_line(tmp_path):
    """Experts saved as transformers holds them in memory (one gate_up_proj / down_proj per layer) are refused
    naming the tensor, not reported as an incomplete download."""
    from helpers import make_tiny_hf_model
    from safetensors.torch import load_file, save_file

    from lit_qlora.convert import convert_hf_checkpoint
    from lit_qlora.utils import UserError

    make_tiny_hf_model("mixtral", tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    for i in range(2):
        pre = f"model.layers.{i}.block_sparse_moe.experts."
        w1, w2, w3 = ([sd.pop(f"{pre}{e}.{n}.weight") for e in range(4)] for n in ("w1", "w2", "w3"))
        sd[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.cat([torch.stack(w1), torch.stack(w3)], dim=1)
        sd[f"model.layers.{i}.mlp.experts.down_proj"] = torch.stack(w2)
    save_file(sd, tmp_path / "model.safetensors")
    with pytest.raises(UserError, match="stores its experts stacked .'model.layers.0.mlp.experts"):
        convert_hf_checkpoint(tmp_path)


class _OutputSizes(torch.utils._python_dispatch.TorchDispatchMode):
    """The element count of every tensor the ops inside it return."""

    def __init__(self) -> None:
        super().__init__()
        self.numels: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.numels += [t.numel() for t in (out if isinstance(out, (tuple, list)) else [out])
                        if isinstance(t, torch.Tensor)]
        return out


def test_expert_backward_makes_no_tensor_of_all_routed_rows_per_expert():
    """The backward of a MoE layer's experts handles the N*k routed rows a few times in all, not once per expert: the
    rows are split per expert (whose backward concatenates the experts' gradients once), not sliced (whose backward
    makes a zero tensor of all N*k rows for each expert: with 64 experts most of a training step's time)."""
    from lit_qlora.config import Config
    from lit_qlora.model import Experts

    E, k, N, C = 16, 2, 64, 32
    config = Config(name="moe", n_layer=1, n_embd=C, n_head=2, intermediate_size=64, vocab_size=64, moe_n_expert=E,
                    moe_top_k=k, moe_intermediate_size=16, hf_architecture="Qwen3MoeForCausalLM")
    experts = Experts(config)
    for p in experts.parameters():
        nn.init.normal_(p, std=0.1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, C, generator=g, requires_grad=True)
    chosen = torch.rand(N, E, generator=g).topk(k, dim=-1).indices
    y = experts(x, chosen, torch.full((N, k), 0.5))
    with _OutputSizes() as sizes:
        y.sum().backward()
    assert len(torch.unique(chosen)) == E and x.grad is not None
    assert sizes.numels.count(N * k * C) < E // 2, sizes.numels  # 4 (torch 2.13); sliced: 2 per expert and more


@pytest.mark.parametrize("mode", ["bnb.nf4", "bnb.nf4-dq", "bnb.fp4"])
@pytest.mark.parametrize("in_features", [128, 96])  # whole blocks per row; blocks straddling rows
@pytest.mark.parametrize("dtype,fp32_kernels", [(torch.float32, None), (torch.bfloat16, False),
                                                (torch.bfloat16, True)])
def test_expert_matmul_equals_the_bitsandbytes_layer(mode, in_features, dtype, fp32_kernels):
    """A quantized expert's training matmul (quantize._ExpertMatmul: its own allocation order, see there) computes what
    the expert's bitsandbytes layer computes, forward and the input's gradient, at 32-true and bf16-true (with the CPU's
    bf16 kernels and with lit_qlora/kernels/cpu_half.py's fp32 kernels)."""
    from lit_qlora.kernels import cpu_half
    from lit_qlora.model import ExpertWeights
    from lit_qlora.quant.quantize import quantize_experts

    dense = ExpertWeights(3, 48, in_features)
    nn.init.normal_(dense.weight, std=0.1)
    experts = QuantizedExpertWeights(dense, mode, dtype)
    quantize_experts(experts, dense.weight.detach(), torch.device("cpu"), dtype)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20, in_features, generator=g).to(dtype).requires_grad_()
    grad = torch.randn(20, 48, generator=g).to(dtype)
    with cpu_half.forced(fp32_kernels):
        y = experts(x, 1)
        assert y.grad_fn is not None and "ExpertMatmul" in type(y.grad_fn).__name__
        (gx,) = torch.autograd.grad(y, x, grad)
        x2 = x.detach().clone().requires_grad_()
        y2 = experts.layers[1](x2)
        (gx2,) = torch.autograd.grad(y2, x2, grad)
    tol = dict(rtol=0, atol=0) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(y, y2, **tol)
    torch.testing.assert_close(gx, gx2, **tol)


def test_the_aux_loss_weight_defaults_to_what_transformers_training_adds(monkeypatch):
    """--router_aux_loss_coef left out: the config's router_aux_loss_coef only where its output_router_logits is true
    (transformers adds the loss only then; gpt-oss-20b's published 0.9 with false must not weigh in), else 0; a flag
    wins; a dense model refuses it."""
    import importlib.util
    import sys

    from helpers import TINY_HF_CONFIGS
    from helpers_train import FINETUNE

    from lit_qlora.config import Config
    from lit_qlora.utils import UserError

    spec = importlib.util.spec_from_file_location("finetune_lora", FINETUNE)
    sft = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, sft)
    spec.loader.exec_module(sft)
    for kind in ("qwen3_moe", "mixtral", "gpt_oss"):
        def config(**over):
            return Config.from_hf_config(dict(TINY_HF_CONFIGS[kind], **over))
        assert sft.router_aux_coef(None, config(output_router_logits=False, router_aux_loss_coef=0.9)) == 0.0
        assert sft.router_aux_coef(None, config(output_router_logits=True, router_aux_loss_coef=0.9)) == 0.9
        assert sft.router_aux_coef(0.25, config(output_router_logits=False, router_aux_loss_coef=0.9)) == 0.25
    dense = Config.from_hf_config(TINY_HF_CONFIGS["llama"])
    assert sft.router_aux_coef(None, dense) == 0.0
    with pytest.raises(UserError, match="not; leave it out"):
        sft.router_aux_coef(0.1, dense)


@pytest.mark.parametrize("family_module", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_router_aux_loss_is_transformers_load_balancing_loss_func_on_the_same_logits(family_module):
    """model.router_aux_loss on the softmax / top-k of given router logits (3 layers, E 6, k 2, skewed so the loss is
    far from its even value k) equals the family's transformers load_balancing_loss_func on those logits within 1e-6,
    without and with an attention mask (padding not counted); so does the gradient in the logits."""
    import importlib

    from lit_qlora.model import router_aux_loss

    hf_loss = importlib.import_module(f"transformers.models.{family_module}.modeling_{family_module}"
                                      ).load_balancing_loss_func
    E, k, B, T = 6, 2, 2, 7
    gen = torch.Generator().manual_seed(11)
    skew = torch.linspace(2.0, -2.0, E)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 4:] = 0
    for attention_mask in (None, mask):
        logits = [(torch.randn(B * T, E, generator=gen) + skew).requires_grad_() for _ in range(3)]
        want = hf_loss(tuple(logits), E, k, attention_mask)
        want_grads = torch.autograd.grad(want, logits)
        routing = [(torch.softmax(x, -1, dtype=torch.float32), x.topk(k, -1).indices) for x in logits]
        keep = None if attention_mask is None else attention_mask.reshape(-1).bool()
        got, load = router_aux_loss(routing, E, keep)
        assert abs(want.item() - k) > 0.1
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        for g, w in zip(torch.autograd.grad(got, logits), want_grads):
            torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-5)
        assert load.sum().item() == 3 * k * (B * T if keep is None else int(keep.sum()))
