"""LoRA: exactness of the adapter and of merging, PEFT interop both ways, HF export, base checks, cross-loading."""
import json
import runpy
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lit_qlora.convert import convert_hf_checkpoint
from lit_qlora.generation import generate
from lit_qlora.loader import load_model, load_model_with_adapter
from lit_qlora.lora import LoRAConfig, load_adapter, lora_modules, lora_state_dict, merge_lora, save_adapter
from lit_qlora.peft_interop import export_peft, import_peft
from lit_qlora.quantize import QUANTIZE_MODES
from lit_qlora.utils import UserError
from tests.helpers import make_tiny_hf_model

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 320
ALL = dict(query=True, key=True, value=True, projection=True, mlp=True, head=True)


def lora_cfg(**targets) -> LoRAConfig:
    flags = {k: False for k in ALL}
    flags.update(targets or ALL)
    return LoRAConfig(r=4, alpha=8, dropout=0.0, **flags)


def tokens(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def randomize_lora(model: torch.nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_A.copy_(torch.randn(m.lora_A.shape, generator=g) * 0.1)
            m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * 0.1)


def adapter_of(model, lora: LoRAConfig) -> dict:
    return {"format": "lit-qlora-adapter-v1", "lora": {k: v.float().clone() for k, v in lora_state_dict(model).items()},
            "lora_config": asdict(lora), "model_config": model.config.to_dict(), "train": {}}


def hf_model(folder: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def run_script(name: str, *args) -> subprocess.CompletedProcess:
    """A script in a fresh interpreter, as a user runs it (slow: only where the exit path itself is tested)."""
    return subprocess.run([sys.executable, str(ROOT / "scripts" / name), *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


def run_script_here(name: str, *args) -> int:
    """A script's CLI (argument parsing included) in this process; returns its exit code."""
    argv = sys.argv
    sys.argv = [str(ROOT / "scripts" / name), *map(str, args)]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
    finally:
        sys.argv = argv
    return 0


def _tiny(tmp_path_factory, kind: str, name: str, **overrides) -> SimpleNamespace:
    folder = tmp_path_factory.mktemp("ckpt") / name
    make_tiny_hf_model(kind, folder, **overrides)
    convert_hf_checkpoint(folder)
    return SimpleNamespace(kind=kind, folder=folder, config=load_model(folder, precision="32-true").config)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return _tiny(tmp_path_factory, "llama", "tiny-llama")


@pytest.fixture(scope="module")
def neox(tmp_path_factory):
    return _tiny(tmp_path_factory, "gpt_neox", "tiny-neox")


@pytest.fixture(scope="module")
def tied(tmp_path_factory):  # tied embeddings + GQA with one kv head: the head LoRA must untie on merge
    return _tiny(tmp_path_factory, "llama3", "tiny-llama3")


@pytest.fixture(params=["llama", "neox", "tied"])
def tiny(request):
    return request.getfixturevalue(request.param)


# ---- exactness ---------------------------------------------------------------------------------
@torch.no_grad()
def test_zero_b_is_the_base_model_and_merging_is_exact(tiny, tmp_path):
    idx = tokens(2, 12)
    base = load_model(tiny.folder, precision="32-true")(idx)
    lora = lora_cfg()
    model = load_model(tiny.folder, precision="32-true", lora=lora, seed=1)
    assert all(m.lora_B.abs().max() == 0 for m in lora_modules(model).values())
    assert torch.equal(model(idx), base)

    randomize_lora(model)
    unmerged = model(idx)
    assert (unmerged - base).abs().max() > 1e-2  # the adapter does something
    adapter_path = tmp_path / "adapter.pth"
    save_adapter(adapter_path, model, lora)

    merge_lora(model)  # in memory
    assert (model(idx) - unmerged).abs().max().item() <= 1e-5

    out = tmp_path / "merged"  # on disk, from the stored base weights
    assert run_script_here("merge_lora.py", "--checkpoint_dir", tiny.folder, "--lora_path", adapter_path, "--out_dir", out) == 0
    assert {"lit_model.safetensors", "model_config.json"} <= {p.name for p in out.iterdir()}
    merged = load_model(out, precision="32-true")
    assert merged.config.tie_embeddings is False
    assert (merged(idx) - unmerged).abs().max().item() <= 1e-5
    assert load_model(out, precision="32-true", quantize="bnb.nf4")(idx).shape == (2, 12, VOCAB)  # re-quantizes


# ---- PEFT --------------------------------------------------------------------------------------
PEFT_TARGETS = {
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"],
    # transformers 5 calls GPT-NeoX's head lm_head (embed_out before): name both so either version adapts it
    "gpt_neox": ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h", "embed_out", "lm_head"],
}


@pytest.mark.parametrize("which,targets", [("llama", ALL), ("neox", ALL), ("llama", dict(query=True, value=True)),
                                           ("neox", dict(query=True, value=True))],
                         ids=["llama-all", "neox-all", "llama-qv", "neox-qv"])
@torch.no_grad()
def test_exported_adapter_runs_in_peft(which, targets, request, tmp_path):
    from peft import PeftModel

    tiny = request.getfixturevalue(which)
    idx = tokens(2, 12, seed=3)
    lora = lora_cfg(**targets)
    model = load_model(tiny.folder, precision="32-true", lora=lora, seed=0)
    randomize_lora(model, seed=4)
    expected = model(idx)
    adapter = adapter_of(model, lora)
    export_peft(adapter, tiny.config, tmp_path / "peft", base_model_name_or_path=str(tiny.folder))

    peft_model = PeftModel.from_pretrained(hf_model(tiny.folder), tmp_path / "peft").eval()
    assert (peft_model(idx).logits - expected).abs().max().item() <= 1e-4

    back = import_peft(tmp_path / "peft", tiny.config)  # our own export comes back as it was
    assert back["lora_config"] == adapter["lora_config"]
    assert back["lora"].keys() == adapter["lora"].keys()
    for k, v in adapter["lora"].items():
        assert torch.equal(back["lora"][k], v), k


@pytest.mark.parametrize("which,peft_targets,rslora", [
    ("llama", PEFT_TARGETS["llama"], False), ("neox", PEFT_TARGETS["gpt_neox"], False), ("llama", ["q_proj", "v_proj"], False),
    ("llama", ["o_proj", "down_proj"], False), ("llama", PEFT_TARGETS["llama"], True), ("neox", "all-linear", False)],
    ids=["llama-all", "neox-all", "llama-qv", "llama-partial-mlp", "llama-rslora", "neox-all-linear"])
@torch.no_grad()
def test_peft_made_adapter_imports_exactly(which, peft_targets, rslora, request, tmp_path):
    from peft import LoraConfig, get_peft_model

    tiny = request.getfixturevalue(which)
    peft_model = get_peft_model(hf_model(tiny.folder), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, use_rslora=rslora,
                                                                  target_modules=peft_targets, task_type="CAUSAL_LM"))
    g = torch.Generator().manual_seed(5)
    for name, p in peft_model.named_parameters():
        if "lora_" in name:
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    idx = tokens(2, 12, seed=6)
    expected = peft_model.eval()(idx).logits
    peft_model.save_pretrained(tmp_path / "peft")

    adapter = load_adapter(tmp_path / "peft", tiny.config)  # a folder: goes through import_peft
    assert adapter["train"]["source"] == "peft"
    if isinstance(peft_targets, list) and len(peft_targets) > 4:
        assert LoRAConfig.from_dict(adapter["lora_config"]).targets() == list(ALL)
    ours = load_model_with_adapter(tiny.folder, adapter, precision="32-true")
    assert (ours(idx) - expected).abs().max().item() <= 1e-4


def _save_peft(tiny, tmp_path, **kw) -> Path:
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(hf_model(tiny.folder), LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM", **kw))
    peft_model.save_pretrained(tmp_path / "peft")
    return tmp_path / "peft"


def test_peft_import_refuses_what_it_cannot_represent(llama, tmp_path):
    folder = _save_peft(llama, tmp_path / "a", target_modules=["q_proj", "v_proj"], layers_to_transform=[0])
    with pytest.raises(UserError, match=r"layers \[0\] only"):
        import_peft(folder, llama.config)
    folder = _save_peft(llama, tmp_path / "b", target_modules=["q_proj", "v_proj"], rank_pattern={"v_proj": 2})
    with pytest.raises(UserError, match="different ranks"):
        import_peft(folder, llama.config)
    folder = _save_peft(llama, tmp_path / "c", target_modules=["q_proj", "v_proj"])
    from safetensors.torch import load_file, save_file

    sd = load_file(folder / "adapter_model.safetensors")
    save_file({k: v for k, v in sd.items() if "layers.1.self_attn.v_proj.lora_B" not in k}, folder / "adapter_model.safetensors")
    with pytest.raises(UserError, match="no lora_B weight for model.layers.1.self_attn.v_proj"):
        import_peft(folder, llama.config)
    save_file({k: v for k, v in sd.items() if "layers.1.self_attn.v_proj" not in k}, folder / "adapter_model.safetensors")
    with pytest.raises(UserError, match="holds no LoRA weights for it"):
        import_peft(folder, llama.config)


# ---- HF export ---------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["llama", "tied"])
@torch.no_grad()
def test_hf_export_of_merged_model_matches(which, request, tmp_path):
    tiny = request.getfixturevalue(which)
    idx = tokens(2, 12, seed=7)
    lora = lora_cfg()
    model = load_model(tiny.folder, precision="32-true", lora=lora, seed=0)
    randomize_lora(model, seed=8)
    expected = model(idx)
    save_adapter(tmp_path / "adapter.pth", model, lora)
    assert run_script_here("export_hf.py", "--checkpoint_dir", tiny.folder, "--lora_path", tmp_path / "adapter.pth",
                           "--out_dir", tmp_path / "hf") == 0
    assert not any(p.name.startswith(".merged") for p in (tmp_path / "hf").iterdir())
    assert (hf_model(tmp_path / "hf")(idx).logits - expected).abs().max().item() <= 1e-4


def test_export_peft_script(llama, tmp_path):
    model = load_model(llama.folder, precision="32-true", lora=lora_cfg(), seed=0)
    save_adapter(tmp_path / "adapter.pth", model, lora_cfg())
    assert run_script_here("export_peft.py", "--lora_path", tmp_path / "adapter.pth", "--checkpoint_dir", llama.folder,
                           "--out_dir", tmp_path / "peft") == 0
    cfg = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["task_type"] == "CAUSAL_LM" and cfg["r"] == 4 and cfg["lora_alpha"] == 8
    assert sorted(cfg["target_modules"]) == sorted(PEFT_TARGETS["llama"])
    assert cfg["rank_pattern"] == {} and cfg["alpha_pattern"] == {}


# ---- adapters of another base ------------------------------------------------------------------
@pytest.mark.parametrize("override", [dict(hidden_size=32, intermediate_size=64), dict(num_hidden_layers=3)],
                         ids=["n_embd", "n_layer"])
def test_adapter_for_another_base_is_refused(llama, override, tmp_path_factory, tmp_path, capsys):
    other = _tiny(tmp_path_factory, "llama", "tiny-other", **override)
    model = load_model(llama.folder, precision="32-true", lora=lora_cfg(), seed=0)
    save_adapter(tmp_path / "adapter.pth", model, lora_cfg())
    with pytest.raises(UserError) as e:
        load_adapter(tmp_path / "adapter.pth", other.config)
    msg = str(e.value)
    assert "\n" not in msg and "tiny-llama" in msg and "tiny-other" in msg
    args = ("--checkpoint_dir", other.folder, "--lora_path", tmp_path / "adapter.pth", "--out_dir", tmp_path / "merged")
    if "hidden_size" in override:  # once as a user runs it: one line on stderr, exit code 2
        res = run_script("merge_lora.py", *args)
        code, err = res.returncode, res.stderr
    else:
        capsys.readouterr()
        code, err = run_script_here("merge_lora.py", *args), capsys.readouterr().err
    assert code == 2 and err.strip().splitlines() == [f"error: {msg}"]
    assert not (tmp_path / "merged").exists()

    export_peft(adapter_of(model, lora_cfg()), llama.config, tmp_path / "peft", base_model_name_or_path="tiny-llama")
    with pytest.raises(UserError) as e:
        load_adapter(tmp_path / "peft", other.config)
    assert "\n" not in str(e.value) and "tiny-llama" in str(e.value) and "tiny-other" in str(e.value)


# ---- cross-loading: trained under any quantization, used under any other -------------------------
QUANTS = [None, *QUANTIZE_MODES]


@pytest.fixture(scope="module")
def trained(llama, tmp_path_factory):
    """One adapter per --quantize value, trained 3 steps (lr 1e-2) and saved; the unquantized model is kept."""
    folder = tmp_path_factory.mktemp("adapters")
    lora = LoRAConfig(r=4, alpha=8, dropout=0.0, query=True, value=True, projection=True, mlp=True, head=True)
    idx = tokens(2, 12, seed=9)
    out = {}
    for q in QUANTS:
        model = load_model(llama.folder, precision="32-true", quantize=q, lora=lora, seed=0)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-2)
        for _ in range(3):
            logits = model(idx[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
        assert all(m.lora_B.abs().max() > 0 for m in lora_modules(model).values())  # B moved
        path = folder / f"{q or 'none'}.pth"
        save_adapter(path, model, lora, {"quantize": q})
        out[q] = (path, model.eval() if q is None else None)
    return out


@pytest.mark.parametrize("train_q", QUANTS, ids=lambda q: f"trained-{q or 'none'}")
def test_adapter_cross_loads_under_every_quantization(llama, trained, train_q, capfd):
    path, _ = trained[train_q]
    prompt = tokens(6, seed=10)
    for q in QUANTS:
        model = load_model_with_adapter(llama.folder, load_adapter(path, llama.config), precision="32-true", quantize=q)
        out = generate(model, prompt, max_new_tokens=4)
        assert out.shape == (10,)
        if train_q is None and q is None:
            reference = trained[None][1]
            assert out.tolist() == generate(reference, prompt, max_new_tokens=4).tolist()
            with torch.no_grad():
                assert torch.equal(model(prompt[None]), reference(prompt[None]))
    captured = capfd.readouterr()
    assert "Unexpected key" not in captured.out + captured.err
