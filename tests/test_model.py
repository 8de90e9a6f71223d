"""Our GPT against transformers for every supported family, checkpoint conversion both ways, and the convert scripts."""
import contextlib
import copy
import io
import json
import runpy
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from lit_qlora.config import NAMES, Config
from lit_qlora.convert import LIT_CONFIG, LIT_WEIGHTS, convert_hf_checkpoint, convert_lit_checkpoint, to_hf_config
from lit_qlora.generation import generate, sample
from lit_qlora.model import GPT
from lit_qlora.utils import UserError
from tests.helpers import TINY_HF_CONFIGS, make_tiny_hf_model

ROOT = Path(__file__).resolve().parents[1]
KINDS = list(TINY_HF_CONFIGS)
VOCAB = 320  # every tiny config


def load_ours(folder: Path) -> GPT:
    config = Config.from_file(folder / LIT_CONFIG)
    model = GPT(config)
    missing, unexpected = model.load_state_dict(load_file(folder / LIT_WEIGHTS), strict=False)
    assert not unexpected
    assert set(missing) == ({"lm_head.weight"} if config.tie_embeddings else set())  # tied: stored once, as wte
    return model.eval()


def tokens(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=KINDS)
def tiny(request, tmp_path_factory):
    """A random tiny HF model of one family, saved and converted to ours (built once per family)."""
    folder = tmp_path_factory.mktemp(request.param)
    # weights 10x the default init: with tiny random weights greedy decoding just repeats one token
    hf = make_tiny_hf_model(request.param, folder, initializer_range=0.2)
    convert_hf_checkpoint(folder)
    return SimpleNamespace(kind=request.param, folder=folder, hf=hf, ours=load_ours(folder))


# ---- our model against transformers -----------------------------------------------------------
@torch.no_grad()
def test_logits_match_transformers(tiny):
    idx = tokens(2, 24)  # longer than mistral's sliding window of 8
    expected = tiny.hf(idx).logits
    got = tiny.ours(idx)
    assert got.shape == (2, 24, VOCAB)
    assert (got - expected).abs().max().item() <= 1e-4


def test_training_gradients_match_transformers(tiny, monkeypatch):
    """Backward through our model equals transformers' in fp32, and in bf16 (where it goes through cpu_attention's
    backward) it is as close to the fp32 gradient as transformers' own bf16 backward is."""
    from lit_qlora import cpu_attention
    calls = []
    fast = cpu_attention.causal_attention
    monkeypatch.setattr(cpu_attention, "causal_attention", lambda *a: calls.append(1) or fast(*a))
    idx = tokens(2, 24, seed=3)
    pad = tiny.hf.config.pad_token_id
    if pad is not None:  # HF's embedding gives its padding row no gradient; ours (always frozen in LoRA) does
        idx[idx == pad] = (pad + 1) % VOCAB

    def embedding_grad(model: torch.nn.Module, dtype: torch.dtype, compiled: bool = False) -> torch.Tensor:
        model = copy.deepcopy(model).to(dtype)
        if compiled:
            model.train()  # compiled blocks serve training steps only
            model.compile_blocks()
        logits = model(idx)
        getattr(logits, "logits", logits).float().logsumexp(-1).sum().backward()
        wte = model.transformer.wte if isinstance(model, GPT) else model.get_input_embeddings()
        return wte.weight.grad.float()

    expected = embedding_grad(tiny.hf, torch.float32)
    torch.testing.assert_close(embedding_grad(tiny.ours, torch.float32), expected, atol=1e-4, rtol=1e-4)
    assert not calls  # fp32 keeps PyTorch's flash backward
    err_ours = (embedding_grad(tiny.ours, torch.bfloat16) - expected).abs().max()
    err_hf = (embedding_grad(tiny.hf, torch.bfloat16) - expected).abs().max()
    assert err_ours <= 1.5 * err_hf + 1e-3 * expected.abs().max()
    sliding = tiny.ours.config.sliding_window_size is not None  # a window needs a mask: SDPA with attn_mask
    assert bool(calls) == (not sliding)
    has_cxx = shutil.which("g++") or shutil.which("clang++")  # torch.compile's CPU kernels are built with one
    if tiny.kind in ("llama", "gpt_neox") and has_cxx:  # finetune --compile: the same check through compiled blocks
        torch.testing.assert_close(embedding_grad(tiny.ours, torch.float32, compiled=True), expected, atol=1e-4, rtol=1e-4)
        err_compiled = (embedding_grad(tiny.ours, torch.bfloat16, compiled=True) - expected).abs().max()
        assert err_compiled <= 1.5 * err_hf + 1e-3 * expected.abs().max()


@pytest.mark.parametrize("T", [7, 100, 200])  # 200: at or above RECOMPUTE_BELOW, ATen's flash backward
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # the model takes this path in bf16 only
def test_cpu_attention_matches_sdpa(T, dtype):
    from lit_qlora.cpu_attention import causal_attention, usable
    gen = torch.Generator().manual_seed(T)
    q, k, v, g = (torch.randn(2, 4, T, 16, generator=gen) for _ in range(4))
    ref = [t.clone().requires_grad_() for t in (q, k, v)]  # fp32 reference: PyTorch's own SDPA
    torch.nn.functional.scaled_dot_product_attention(*ref, is_causal=True, scale=0.25).backward(g)
    ours = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    assert usable(*ours) == (dtype == torch.bfloat16)
    out = causal_attention(*ours, 0.25)
    out.backward(g.to(dtype))
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25)
    torch.testing.assert_close(out.float(), expected, **tol)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.grad.float(), b.grad, **tol)


@torch.no_grad()
def test_kv_cache_decoding_matches_full_forward(tiny):
    model, idx = tiny.ours, tokens(2, 24, seed=1)
    full = model(idx)
    model.set_kv_cache(batch_size=2, max_seq_length=24)
    try:
        steps = [model(idx[:, :10], input_pos=torch.arange(10))]  # prefill
        steps += [model(idx[:, t:t + 1], input_pos=torch.tensor([t])) for t in range(10, 24)]
    finally:
        model.clear_kv_cache()
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-4, rtol=0)


def test_greedy_generation_matches_transformers(tiny):
    prompt = tokens(8, seed=2)
    hf = tiny.hf
    hf.generation_config.eos_token_id = None  # the tiny models' default eos (e.g. 2) may be produced: never stop early
    with torch.no_grad():
        expected = hf.generate(prompt[None], attention_mask=torch.ones(1, 8, dtype=torch.long), do_sample=False,
                               max_new_tokens=12, eos_token_id=None, pad_token_id=0)[0]
    assert expected.shape == (20,) and len(set(expected[8:].tolist())) >= 3  # a real continuation, not one token repeated
    streamed = []
    got = generate(tiny.ours, prompt, max_new_tokens=12, temperature=0.0, on_token=streamed.append)
    assert got.tolist() == expected.tolist()
    assert streamed == got[8:].tolist()
    assert tiny.ours.kv_caches is None


# ---- generation details (one family is enough) ------------------------------------------------
@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama_gen")
    make_tiny_hf_model("llama", folder, initializer_range=0.2)
    convert_hf_checkpoint(folder)
    return load_ours(folder)


def test_generate_stops_at_eos_and_checks_length(llama):
    prompt = tokens(5, seed=3)
    greedy = generate(llama, prompt, max_new_tokens=6)
    assert len(set(greedy[5:].tolist())) >= 3
    eos = int(greedy[7])  # the third new token
    first = int((greedy[5:] == eos).nonzero()[0])  # it may also appear earlier
    out = generate(llama, prompt, max_new_tokens=6, eos_ids=[eos, 10**6])
    assert out.tolist() == greedy[:5 + first + 1].tolist()  # eos included, nothing after
    with pytest.raises(UserError, match="context"):
        generate(llama, prompt, max_new_tokens=llama.config.block_size)


def test_sample():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.5, -1.0])
    assert sample(logits).tolist() == [1]
    assert sample(logits, temperature=1.0, top_k=1).tolist() == [1]
    assert sample(logits, temperature=1.0, top_p=0.01).tolist() == [1]
    draws = lambda **kw: [int(sample(logits, 1.0, generator=torch.Generator().manual_seed(s), **kw)) for s in range(200)]  # noqa: E731
    assert set(draws(top_k=2)) == {1, 3}
    # p = softmax: ~[.03 .55 .07 .34 .01]; top_p=0.8 keeps 1 and 3 (0.55 < 0.8 <= 0.89)
    assert set(draws(top_p=0.8)) == {1, 3}
    assert len(set(draws())) >= 4
    assert draws() == draws()  # the generator makes sampling reproducible


# ---- conversion ------------------------------------------------------------------------------
def test_round_trip_is_bit_identical_and_loads_in_transformers(tiny, tmp_path):
    import transformers

    out = convert_lit_checkpoint(tiny.folder, tmp_path / "export")
    original, exported = load_file(tiny.folder / "model.safetensors"), load_file(out / "model.safetensors")
    assert set(exported) == set(original)  # tied models: no lm_head in either
    for key, t in original.items():
        assert torch.equal(exported[key], t), key
    ours_cfg = Config.from_file(tiny.folder / LIT_CONFIG)
    assert replace(Config.from_hf_config(out / "config.json"), name="") == replace(ours_cfg, name="")

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert reloaded.dtype == torch.float32  # the export declares the dtype of its weights
    idx = tokens(2, 16, seed=4)
    with torch.no_grad():
        # not bit-equal for Phi: the export names gelu_new (same tanh GELU, other kernel) gelu_pytorch_tanh
        torch.testing.assert_close(reloaded(idx).logits, tiny.hf(idx).logits, atol=1e-5, rtol=0)


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
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))


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


# ---- named configs ---------------------------------------------------------------------------
def test_every_named_config_constructs():
    assert len(NAMES) > 50
    for name in NAMES:
        c = Config.from_name(name)
        assert c.name == name and c.hf_architecture in {
            "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "GemmaForCausalLM", "GPTNeoXForCausalLM",
            "FalconForCausalLM", "PhiForCausalLM", "StableLmForCausalLM"}
        assert c.n_head % c.n_query_groups == 0 and c.rope_n_elem % 2 == 0 and c.rope_n_elem > 0
    with pytest.raises(Exception, match="did you mean"):
        Config.from_name("Llama-2-7b")


@pytest.mark.parametrize("name", NAMES)
def test_named_config_round_trips_through_transformers(name):
    import transformers

    ours = Config.from_name(name)
    d = to_hf_config(ours)
    hf = transformers.AutoConfig.for_model(d.pop("model_type"), **d)
    back = Config.from_hf_config(hf.to_dict() | {"architectures": d["architectures"]})
    # hf_extra may gain defaults (e.g. GPT-NeoX attention_bias=True): equal when the exports are equal
    assert replace(back, name=name, hf_extra={}) == replace(ours, hf_extra={})
    assert to_hf_config(back) == to_hf_config(ours)
    # the transformers side sees the same model
    assert hf.vocab_size == ours.vocab_size and hf.hidden_size == ours.n_embd and hf.num_hidden_layers == ours.n_layer
    assert hf.num_attention_heads == ours.n_head
    kv = getattr(hf, "num_key_value_heads", None) or getattr(hf, "num_kv_heads", None)
    if ours.hf_architecture == "GPTNeoXForCausalLM":
        kv = hf.num_attention_heads
    elif ours.hf_architecture == "FalconForCausalLM" and not hf.new_decoder_architecture:
        kv = 1 if hf.multi_query else hf.num_attention_heads
    assert kv == ours.n_query_groups
    assert (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads) == ours.head_size
    rope = hf.rope_parameters if hasattr(hf, "rope_parameters") else {"rope_theta": hf.rope_theta}
    assert rope["rope_theta"] == ours.rope_base
    assert rope.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0)) == ours.rotary_percentage
    if ours.rope_scaling:
        assert rope["rope_type"] == "llama3" and rope["factor"] == ours.rope_scaling["factor"]
    assert hf.tie_word_embeddings == ours.tie_embeddings


# ---- the scripts -----------------------------------------------------------------------------
HF_SCRIPT, LIT_SCRIPT = ROOT / "scripts/convert_hf_checkpoint.py", ROOT / "scripts/convert_lit_checkpoint.py"


def run_script(script: Path, *args: str) -> SimpleNamespace:
    """Run a script as `python script args` would, but in this process (a fresh interpreter costs seconds)."""
    argv, err = sys.argv, io.StringIO()
    sys.argv = [str(script), *map(str, args)]
    code = 0
    try:
        with contextlib.redirect_stderr(err):
            runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:
        code = e.code
    finally:
        sys.argv = argv
    return SimpleNamespace(returncode=code, stderr=err.getvalue())


def spawn(script: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(script), *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT.parent)


def assert_one_line_error(returncode, stderr: str, expect: str) -> None:
    assert returncode == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in stderr, stderr
    assert expect in lines[0], stderr


@pytest.fixture(scope="module")
def broken(tmp_path_factory) -> Path:
    """Folders with one thing wrong each."""
    base = tmp_path_factory.mktemp("broken")
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
    return base


@pytest.mark.parametrize("case", ["missing_folder", "no_config", "unsupported", "missing_shard", "missing_tensor",
                                  "export_unconverted", "export_missing_folder"])
def test_script_errors_are_one_line(broken, case):
    b = broken
    script, args, expect = {
        "missing_folder": (HF_SCRIPT, ["--checkpoint_dir", b / "nope"], str(b / "nope")),
        "no_config": (HF_SCRIPT, ["--checkpoint_dir", b / "empty"], str(b / "empty" / "config.json")),
        "unsupported": (HF_SCRIPT, ["--checkpoint_dir", b / "bert"], "'BertForMaskedLM' in " + str(b / "bert" / "config.json")),
        "missing_shard": (HF_SCRIPT, ["--checkpoint_dir", b / "shard"], (b / "lost_shard.txt").read_text()),
        "missing_tensor": (HF_SCRIPT, ["--checkpoint_dir", b / "tensor"], "'model.layers.1.mlp.up_proj.weight'"),
        "export_unconverted": (LIT_SCRIPT, ["--checkpoint_dir", b / "tensor", "--out_dir", b / "x"], str(b / "tensor" / LIT_CONFIG)),
        "export_missing_folder": (LIT_SCRIPT, ["--checkpoint_dir", b / "nope", "--out_dir", b / "x"], str(b / "nope")),
    }[case]
    r = run_script(script, *args)
    assert_one_line_error(r.returncode, r.stderr, expect)


def test_scripts_in_a_fresh_interpreter(broken, tmp_path):
    """The real command lines: a user error (exit 2, one line), then convert (bf16) and export."""
    ok = tmp_path / "ok"
    make_tiny_hf_model("llama3", ok)
    (ok / "tokenizer.json").write_text("{}")
    (ok / "tokenizer_config.json").write_text("{}")
    failing, converting = spawn(HF_SCRIPT, "--checkpoint_dir", broken / "tensor"), spawn(HF_SCRIPT, "--checkpoint_dir", ok, "--dtype", "bf16")
    _, err = failing.communicate(timeout=120)
    assert_one_line_error(failing.returncode, err, "'model.layers.1.mlp.up_proj.weight'")
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
