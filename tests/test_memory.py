"""The memory estimator (lit_qlora/memory.py): exact weight and saved-activation bytes, monotonicity, checkpointing,
--micro_batch_size auto and --estimate_only. (Predicted vs measured peak RSS is a benchmark:
scripts/bench/bench_estimator.py.)"""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import TINY_HF_CONFIGS
from helpers_train import env

from lit_qlora.config import Config
from lit_qlora.kernels import cpu_half
from lit_qlora.lora import LoRAConfig
from lit_qlora.memory import GiB, estimate_training_memory, pick_micro_batch_size, weight_bytes
from lit_qlora.quant.quant_mode import QuantMode
from lit_qlora.quant.quantize import memory_report
from lit_qlora.train.training import head_chunk

ROOT = Path(__file__).resolve().parents[1]
LLAMA = dict(name="mem-llama", n_layer=2, n_head=8, n_query_groups=2, n_embd=256, intermediate_size=704,
             vocab_size=1000, block_size=512)
NEOX = dict(name="mem-neox", hf_architecture="GPTNeoXForCausalLM", n_layer=2, n_head=4, n_embd=128,
            intermediate_size=512,
            vocab_size=500, block_size=512, norm_class="LayerNorm", bias=True, mlp_class="GptNeoxMLP",
            activation="gelu", parallel_residual=True, rotary_percentage=0.25)
# a mixture of experts (Qwen3-MoE): 8 experts, top 2, the middle layer a dense MLP
MOE = dict(name="mem-moe", hf_architecture="Qwen3MoeForCausalLM", n_layer=3, n_head=4, n_query_groups=2, n_embd=128,
           head_size=32, intermediate_size=256, vocab_size=500, block_size=512, qk_norm="head", moe_n_expert=8,
           moe_top_k=2, moe_intermediate_size=64, moe_norm_topk=True, moe_dense_layers=[1])
QV = LoRAConfig(r=8, alpha=16, dropout=0.05)
ATTN = LoRAConfig(r=8, alpha=16, dropout=0.0, key=True, projection=True, head=True)
ALL = LoRAConfig(r=8, alpha=16, dropout=0.05, key=True, projection=True, mlp=True, head=True)
# a LoRA pair per expert (lora.LoRAExperts) beside attention's; with dropout, on the experts and the router alone
EXPERTS = LoRAConfig(r=8, alpha=16, dropout=0.0, key=True, projection=True, experts=True)
EXPERTS_ROUTER = LoRAConfig(r=8, alpha=16, dropout=0.05, experts=True, router=True)
DORA_QV = LoRAConfig(r=8, alpha=16, dropout=0.0, dora=True)
DORA_ALL = LoRAConfig(r=8, alpha=16, dropout=0.05, key=True, projection=True, mlp=True, head=True, dora=True)
BIG = Config.from_name("Llama-2-7b-hf")
# the families of issue 33 as the model tests build them (soft-caps that clip, sliding windows shorter than the
# sequences, QK-norm per head and over the projection, post-norms, NoPE layers, Gemma 3's local RoPE, yarn, longrope)
FAMILIES = ("qwen3", "gemma2", "gemma3", "olmo2", "phi3", "smollm3", "mistral_nemo", "llama_longrope")


def _checkpoint(folder: Path, config: Config) -> Path:
    from lit_qlora.checkpoint import LIT_CONFIG, LIT_WEIGHTS, lit_param_shapes, write_safetensors_stream

    g = torch.Generator().manual_seed(0)
    shapes = lit_param_shapes(config)
    write_safetensors_stream(folder / LIT_WEIGHTS, [(k, s, torch.bfloat16) for k, s in shapes.items()],
                             ((k, (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16)) for k, s in shapes.items()))
    config.save(folder / LIT_CONFIG)
    return folder


@pytest.fixture(scope="module")
def memory_ckpts(tmp_path_factory):
    out = {}
    for name, cfg in (("llama", LLAMA), ("neox", NEOX), ("moe", MOE)):
        folder = tmp_path_factory.mktemp(name)
        out[name] = (_checkpoint(folder, Config(**cfg)), Config(**cfg))
    for name in FAMILIES + ("gpt_oss",):
        config = Config.from_hf_config(TINY_HF_CONFIGS[name])
        out[name] = (_checkpoint(tmp_path_factory.mktemp(name), config), config)
    return out


@pytest.mark.parametrize("quantize", QuantMode.names())
@pytest.mark.parametrize("arch", ["llama", "moe"])
def test_quantized_bytes_match_bitsandbytes(memory_ckpts, quantize, arch):
    """Quantized and dense bytes as the loaded model holds them (a mixture of experts: one bitsandbytes layer per
    expert, the router dense)."""
    from lit_qlora.loader import load_model

    folder, config = memory_ckpts[arch]
    model = load_model(folder, precision="bf16-true", quantize=quantize, lora=QV, config=config, seed=0)
    real = memory_report(model)
    predicted = weight_bytes(config, QV, "bf16-true", quantize)
    assert predicted["quantized"] == real["quantized_bytes"]
    # the report counts LoRA as dense
    assert predicted["dense"] + 2 * sum(predicted["lora_numels"]) == real["dense_bytes"]
    assert sum(predicted["lora_numels"]) == real["trainable_params"]
    assert predicted["quantized_params"] == real["quantized_params"]
    # the figures the estimator is built on, for a large layer
    bits = 8 * QuantMode(quantize).layer_bytes(4096, 4096) / 4096**2
    assert bits == pytest.approx({"bnb.int8": 8 + 32 / 4096}.get(quantize, 4.127 if quantize.endswith("-dq") else 4.5),
                                 abs=2e-3)


@pytest.mark.parametrize("arch", ["moe", "gpt_oss"])
def test_expert_lora_parameters_are_counted(memory_ckpts, arch):
    """A LoRA on the experts (a pair per expert, [E, r, in] and [E, out, r]) and the router: the estimate's trainable
    parameters are the loaded model's, and its optimizer state follows them."""
    from lit_qlora.loader import load_model

    folder, config = memory_ckpts[arch]
    model = load_model(folder, precision="32-true", quantize="bnb.nf4", lora=EXPERTS_ROUTER, config=config, seed=0)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    predicted = weight_bytes(config, EXPERTS_ROUTER, "32-true", "bnb.nf4")
    assert sum(predicted["lora_numels"]) == trainable
    est = estimate_training_memory(config, EXPERTS_ROUTER, "32-true", "bnb.nf4", micro_batch_size=1, seq_length=16)
    assert est.extra["optimizer_state"] == pytest.approx(2 * 4 * trainable, abs=4 * len(predicted["lora_numels"]))


def _saved_bytes(model, config: Config, B: int, T: int, autocast: bool) -> int:
    """Bytes of the distinct storages autograd saves in one training forward + loss (what backward will need), the
    loss computed as training computes it (GPT(..., targets=...))."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
        return t

    idx = torch.randint(0, config.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))
    ctx = torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ctx:
        model(idx, targets=idx, lm_head_chunk=head_chunk(config))
    return sum(seen.values())


@pytest.mark.parametrize("arch,lora,precision,quantize,ac", [
    ("llama", QV, "bf16-true", None, False),
    ("llama", ALL, "bf16-true", None, False),
    ("llama", QV, "bf16-true", "bnb.nf4-dq", False),
    # not int8: bitsandbytes keeps its input in `ctx.tensors`, which saved-tensor hooks cannot see
    ("llama", ALL, "32-true", None, False),
    ("llama", ALL, "bf16-true", None, True),
    ("llama", ALL, "bf16-mixed", None, False),
    ("neox", ALL, "bf16-true", None, False),
    ("neox", QV, "32-true", None, True),
    # DoRA: the sum its factor multiplies, and with dropout its own dropped-out input
    ("llama", DORA_QV, "32-true", "bnb.nf4-dq", False),
    ("llama", DORA_ALL, "bf16-true", None, False),
    ("llama", DORA_ALL, "bf16-mixed", None, False),
    ("neox", DORA_ALL, "32-true", None, False),
    ("neox", DORA_QV, "bf16-true", "bnb.nf4-dq", True),
    ("moe", ATTN, "32-true", None, False),
    ("moe", QV, "bf16-true", "bnb.nf4-dq", False),
    ("moe", ATTN, "32-true", "bnb.nf4", False),
    ("moe", ATTN, "bf16-mixed", None, False),
    ("moe", QV, "bf16-true", None, True),
    # the newer families: what their blocks add (Gemma 2's eager soft-capped attention, the post-norms, per-head and
    # whole-projection QK-norm, Gemma 3's second RoPE table, the masks of sliding windows shorter than the sequence,
    # NoPE layers' unrotated q and k)
    *[(arch, lora, "32-true", None, False) for arch in FAMILIES for lora in (QV, ALL)],
    *[(arch, ALL, "bf16-true", None, False) for arch in ("gemma2", "gemma3", "olmo2", "phi3", "smollm3")],
    ("gemma3", QV, "bf16-true", "bnb.nf4-dq", False),
    ("gemma2", ALL, "32-true", None, True),
    # gpt-oss: sink attention (k and v one zero row longer, the float mask of sink logits), biased experts, the clamped
    # SwiGLU's plain autograd ops
    ("gpt_oss", QV, "32-true", None, False),
    ("gpt_oss", ATTN, "32-true", None, False),
    ("gpt_oss", ATTN, "bf16-true", None, False),
    ("moe", EXPERTS, "32-true", None, False),
    ("moe", EXPERTS_ROUTER, "bf16-true", "bnb.nf4-dq", False),
    ("gpt_oss", EXPERTS, "bf16-true", None, False),
    ("gpt_oss", EXPERTS_ROUTER, "32-true", None, False),
])
def test_saved_activations_match_autograd(memory_ckpts, arch, lora, precision, quantize, ac):
    """The activation model walks GPT.forward; autograd's saved tensors must add up to the same bytes."""
    from lit_qlora.loader import load_model

    folder, config = memory_ckpts[arch]
    model = load_model(folder, precision=precision, quantize=quantize, lora=lora, config=config, seed=0)
    model.activation_checkpointing = ac
    model.train()
    B, T = 2, 64
    # bf16-true on a CPU with native bf16 (bf16 kernels) and without (fp32 kernels, lit_qlora/kernels/cpu_half.py)
    for fp32_kernels in (False, True):
        with cpu_half.forced(fp32_kernels):
            measured = _saved_bytes(model, config, B, T, autocast=precision.endswith("mixed"))
            est = estimate_training_memory(config, lora, precision, quantize, micro_batch_size=B, seq_length=T,
                                           activation_checkpointing=ac)
        if precision.endswith("mixed"):  # autocast's cache of weight copies is approximated: at most one bf16 copy
            copies = 2 * sum(p.numel() for p in model.parameters() if p.requires_grad)  # of the LoRA weights off
            assert est.extra["saved_for_backward"] == pytest.approx(measured, abs=copies)
        else:
            assert est.extra["saved_for_backward"] == pytest.approx(measured, rel=1e-4)


@pytest.mark.parametrize("quantize", [None, "bnb.nf4-dq", "bnb.int8"])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("ac", [False, True])
def test_estimate_grows_with_micro_batch_size(quantize, device, ac):
    ests = [estimate_training_memory(BIG, QV, "bf16-true", quantize, micro_batch_size=b, seq_length=512,
                                     activation_checkpointing=ac, device_type=device) for b in (1, 2, 3, 4, 8, 16)]
    totals = [e.total for e in ests]
    assert all(a <= b for a, b in zip(totals, totals[1:]))  # equal while loading is the peak (tiny batches)
    assert totals[-1] > totals[0]
    training = [e.extra["live_dynamic"] for e in ests]  # the micro-batch's own tensors always grow
    assert all(a < b for a, b in zip(training, training[1:]))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_checkpointing_lowers_activations(device):
    kw = dict(config=BIG, lora=ALL, precision="bf16-true", quantize="bnb.nf4-dq", micro_batch_size=4, seq_length=1024,
              device_type=device)
    plain, ckpt = estimate_training_memory(**kw), estimate_training_memory(activation_checkpointing=True, **kw)
    assert ckpt.parts["activations saved"] < plain.parts["activations saved"] / 4
    assert ckpt.total < plain.total
    assert plain.parts["quantized weights"] == ckpt.parts["quantized weights"]
    # the 7B model's 4-bit weights: ~6.6B quantized parameters at ~4.13 bits
    assert 3.0 < plain.parts["quantized weights"] / GiB < 3.4


def test_auto_picks_the_largest_fitting_micro_batch():
    kw = dict(config=BIG, lora=QV, precision="bf16-true", quantize="bnb.nf4-dq", seq_length=512, device_type="cuda")
    for budget_gb in (7, 12, 24, 40):
        mbs, est = pick_micro_batch_size(budget_gb * GiB, **kw)
        assert mbs >= 1 and est.total <= budget_gb * GiB
        assert est.settings["micro_batch_size"] == mbs
        assert estimate_training_memory(micro_batch_size=mbs + 1, **kw).total > budget_gb * GiB
    assert pick_micro_batch_size(1 * GiB, **kw)[0] == 0  # not even the weights fit


def _finetune(*args, cwd=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "finetune" / "lora.py"), *map(str, args)], capture_output=True,
                          text=True, cwd=cwd, timeout=120, env=env())


def test_estimate_only_exits_before_loading(tmp_path):
    """A folder with nothing but model_config.json: no weights, no tokenizer, no data to load."""
    folder = tmp_path / "model-without-weights"
    folder.mkdir()
    BIG.save(folder / "model_config.json")
    res = _finetune("--checkpoint_dir", folder, "--data_dir", tmp_path / "no-data", "--out_dir", tmp_path / "out",
                    "--quantize", "bnb.nf4-dq", "--micro_batch_size", "2", "--max_seq_length", "512", "--estimate_only",
                    "true")
    assert res.returncode == 0, res.stderr
    assert "Estimated peak training memory" in res.stdout and "quantized weights" in res.stdout
    assert not (tmp_path / "out").exists()

    res = _finetune("--checkpoint_dir", folder, "--data_dir", tmp_path / "no-data", "--out_dir", tmp_path / "out",
                    "--quantize", "bnb.nf4-dq", "--micro_batch_size", "auto", "--memory_budget", "12",
                    "--max_seq_length", "512", "--accelerator", "cpu", "--estimate_only", "true", "--precision",
                    "bf16-true")
    assert res.returncode == 0, res.stderr
    mbs, _ = pick_micro_batch_size(12 * GiB, config=BIG, lora=LoRAConfig(), quantize="bnb.nf4-dq", seq_length=512)
    assert f"--micro_batch_size auto: {mbs}," in res.stdout and f"micro batch {mbs} x 512 tokens" in res.stdout

    res = _finetune("--checkpoint_dir", folder, "--data_dir", tmp_path / "no-data", "--quantize", "bnb.nf4-dq",
                    "--micro_batch_size", "auto", "--memory_budget", "1", "--max_seq_length", "512", "--accelerator",
                    "cpu")
    assert res.returncode == 2 and res.stderr.strip().splitlines()[-1].startswith("error: even --micro_batch_size 1")


def test_estimate_memory_script(tmp_path):
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "estimate_memory.py"), "--model_name", "Llama-2-7b-hf",
                          "--quantize", "bnb.nf4-dq", "--micro_batch_size", "2", "--seq_length", "256", "--device",
                          "cuda", "--json", "true"], capture_output=True, text=True, cwd=ROOT, timeout=60, env=env())
    assert res.returncode == 0, res.stderr
    est = json.loads(res.stdout)
    assert est["settings"]["micro_batch_size"] == 2 and est["device_type"] == "cuda"
    assert est["total_gb"] == pytest.approx(sum(est["parts_gb"].values()))


@pytest.mark.parametrize("optimizer", ["AdamW", "AdamW8bit", "PagedAdamW", "PagedAdamW8bit", "PagedAdamW32bit"])
@pytest.mark.parametrize("precision", ["bf16-true", "32-true"])
def test_optimizer_state_matches_the_real_optimizer(memory_ckpts, optimizer, precision):
    """The planner's optimizer term against the state the optimizer really allocates after a step (8-bit state for
    the large LoRA tensors, fp32 for the small ones; torch's AdamW in the weights' dtype)."""
    from lit_qlora.loader import load_model
    from lit_qlora.train.training import make_optimizer

    folder, config = memory_ckpts["llama"]
    lora = LoRAConfig(r=16, alpha=16, dropout=0.0, key=True, projection=True, mlp=True, head=True)
    model = load_model(folder, precision=precision, lora=lora, config=config, seed=0)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(optimizer, params, 1e-3, 0.0, "cpu")
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for state in opt.state.values()
                for t in state.values() if torch.is_tensor(t) and t.numel() > 1}  # (bitsandbytes shares its qmaps)
    real = sum(storages.values())
    est = estimate_training_memory(config, lora, precision, None, optimizer=optimizer, micro_batch_size=1,
                                   seq_length=16)
    assert est.extra["optimizer_state"] == pytest.approx(real, rel=0.02, abs=4096)


@pytest.mark.parametrize("arch", ["llama", "neox"])
@pytest.mark.parametrize("lora", [QV, ALL], ids=["frozen_head", "head_lora"])
def test_logits_term_matches_what_the_loop_holds(memory_ckpts, arch, lora):
    """The logits the training loop holds through backward: none with a frozen dense head (the loss makes one chunk at
    a time in forward, losses.head_cross_entropy); with a LoRA on the head, the chunks GPT(lm_head_chunk=...) keeps."""
    from lit_qlora.loader import load_model
    from lit_qlora.losses import head_chunk_rows

    folder, config = memory_ckpts[arch]
    model = load_model(folder, precision="bf16-true", lora=lora, config=config, seed=0).train()
    B, T = 3, 40
    est = estimate_training_memory(config, lora, "bf16-true", None, micro_batch_size=B, seq_length=T)
    if lora is QV:
        assert type(model.lm_head) is torch.nn.Linear and not model.lm_head.weight.requires_grad
        assert est.extra["logits"] == 0 and est.extra["chunk_tokens"] == min(head_chunk_rows(config.vocab_size), B * T)
        return
    idx = torch.randint(0, config.vocab_size, (B, T))
    out = model(idx, lm_head_chunk=head_chunk(config))
    held = sum(t.numel() * t.element_size() for t in (out if isinstance(out, list) else [out]))
    assert est.extra["logits"] == held


# ---- sharded (--strategy fsdp): per-rank figures -------------------------------------------------------------------
@pytest.mark.parametrize("quantize", [None, "bnb.nf4-dq"])
def test_sharded_estimate_is_per_rank(quantize):
    """Each rank holds 1/world of every sharded term (the 4-bit block scales stay whole), plus what FSDP gathers for
    compute; the micro-batch's own tensors do not shrink. (Rank 0's weight bytes are checked against a real sharded
    load, to the byte, in tests/test_distributed.py.)"""
    kw = dict(config=BIG, lora=ALL, precision="bf16-true", quantize=quantize, micro_batch_size=2, seq_length=512,
              device_type="cuda", activation_checkpointing=True)
    one = estimate_training_memory(**kw)
    w = weight_bytes(BIG, ALL, "bf16-true", quantize)
    packed = sum(-(-o * i // 2) for _, o, i in w["quantized_shapes"])
    for world in (2, 4):
        est = estimate_training_memory(shard_world=world, **kw)
        p, p1 = est.parts, one.parts
        assert p["quantized weights"] == pytest.approx(p1["quantized weights"] - packed + packed / world, rel=1e-4)
        for k in ("dense weights", "LoRA weights + grads", "optimizer state"):
            assert p[k] == pytest.approx(p1[k] / world, rel=1e-3), k
        assert 0 < p["gathered weights (fsdp)"] < p1["quantized weights"] + p1["dense weights"]
        assert est.extra["live_dynamic"] == one.extra["live_dynamic"]
        assert est.total < one.total and f"sharded over {world} ranks" in est.table()


def test_sharded_70b_fits_two_24gb_cards():
    """The case FSDP-QLoRA was made for (Answer.AI): Llama 2 70B in nf4-dq does not fit one 24 GB card, sharded over
    two it does (micro batch 1 x 512 tokens, activation checkpointing)."""
    kw = dict(config=Config.from_name("Llama-2-70b-hf"), lora=QV, precision="bf16-true", quantize="bnb.nf4-dq",
              micro_batch_size=1, seq_length=512, device_type="cuda", activation_checkpointing=True)
    assert estimate_training_memory(**kw).total > 24e9
    assert estimate_training_memory(shard_world=2, **kw).total < 22 * GiB


def test_estimate_only_with_fsdp_is_per_rank(tmp_path):
    folder = tmp_path / "model-without-weights"
    folder.mkdir()
    BIG.save(folder / "model_config.json")
    args = ["--checkpoint_dir", folder, "--data_dir", tmp_path / "no-data", "--out_dir", tmp_path / "out", "--quantize",
            "bnb.nf4-dq", "--micro_batch_size", "2", "--max_seq_length", "512", "--accelerator", "cpu",
            "--devices", "2", "--strategy", "fsdp", "--estimate_only", "true", "--precision", "bf16-true"]
    res = _finetune(*args)
    assert res.returncode == 0, res.stderr
    assert "per rank, sharded over 2 ranks (fsdp)" in res.stdout and "gathered weights (fsdp)" in res.stdout
    expected = estimate_training_memory(BIG, LoRAConfig(), "bf16-true", "bnb.nf4-dq", micro_batch_size=2,
                                        seq_length=512, shard_world=2)
    assert re.search(rf"\| Total +\| {expected.total_gb:.3f} \|", res.stdout), res.stdout
    assert not (tmp_path / "out").exists()
