"""The adapter file: its base check, loading under every quantization, files written by earlier versions."""
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from helpers import ROOT, adapter_of, converted_tiny, lora_cfg, random_tokens, run_script_here
from helpers_train import run_script

from lit_qlora.adapter import Adapter
from lit_qlora.config import Config
from lit_qlora.convert import write_random_checkpoint
from lit_qlora.loader import load_model, load_model_with_adapter
from lit_qlora.lora import LoRAConfig, lora_modules
from lit_qlora.quant.quant_mode import QuantMode
from lit_qlora.train.training import find_resume
from lit_qlora.utils import UserError


@pytest.mark.parametrize("override", [dict(hidden_size=32, intermediate_size=64), dict(num_hidden_layers=3)],
                         ids=["n_embd", "n_layer"])
def test_adapter_for_another_base_is_refused(lora_llama, override, tmp_path_factory, tmp_path, capsys):
    other = converted_tiny(tmp_path_factory, "llama", "tiny-other", **override)
    model = load_model(lora_llama.folder, precision="32-true", lora=lora_cfg(), seed=0)
    Adapter.of_model(model, lora_cfg()).save(tmp_path / "adapter.pth")
    with pytest.raises(UserError) as e:
        Adapter.load(tmp_path / "adapter.pth", other.config)
    msg = str(e.value)
    assert "\n" not in msg and "tiny-llama" in msg and "tiny-other" in msg
    args = ("--checkpoint_dir", other.folder, "--lora_path", tmp_path / "adapter.pth", "--out_dir", tmp_path / "merged")
    if "hidden_size" in override:  # once as a user runs it: one line on stderr, exit code 2
        res = run_script(ROOT / "scripts" / "merge_lora.py", list(args))
        code, err = res.returncode, res.stderr
    else:
        capsys.readouterr()
        code, err = run_script_here("merge_lora.py", *args), capsys.readouterr().err
    assert code == 2 and err.strip().splitlines() == [f"error: {msg}"]
    assert not (tmp_path / "merged").exists()

    adapter_of(model, lora_cfg()).export_peft(lora_llama.config, tmp_path / "peft",
                base_model_name_or_path="tiny-llama")
    with pytest.raises(UserError) as e:
        Adapter.load(tmp_path / "peft", other.config)
    assert "\n" not in str(e.value) and "tiny-llama" in str(e.value) and "tiny-other" in str(e.value)


QUANTS = [None, *QuantMode.names()]
# how far the adapter's effect on a quantized base may stray from its effect on the dense one, relative to its size:
# the LoRA branch sees the quantized model's activations. Measured on this model: 0.12-0.15 for the 4-bit modes, 0.01
# for int8; an adapter that is not applied gives 1.0
TOLERANCE = {"bnb.nf4": 0.3, "bnb.nf4-dq": 0.3, "bnb.fp4": 0.3, "bnb.fp4-dq": 0.3, "bnb.int8": 0.05}


@pytest.fixture(scope="module")
def cross_trained_adapters(lora_llama, tmp_path_factory):
    """One adapter per --quantize value, trained 3 steps (lr 1e-2) and saved; the unquantized model is kept."""
    folder = tmp_path_factory.mktemp("adapters")
    lora = LoRAConfig(r=4, alpha=8, dropout=0.0, query=True, value=True, projection=True, mlp=True, head=True)
    idx = random_tokens(2, 12, seed=9)
    out = {}
    for q in QUANTS:
        model = load_model(lora_llama.folder, precision="32-true", quantize=q, lora=lora, seed=0)
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
        Adapter.of_model(model, lora, {"quantize": q}).save(path)
        out[q] = (path, model.eval() if q is None else None)
    return out


@pytest.mark.parametrize("train_q", QUANTS, ids=lambda q: f"trained-{q or 'none'}")
@torch.no_grad()
def test_adapter_cross_loads_under_every_quantization(lora_llama, cross_trained_adapters, train_q, capfd):
    """An adapter trained under any --quantize is applied under every other: what it adds to the logits of the
    quantized base equals what it adds to the dense base, up to the quantization's own error (an adapter silently not
    applied adds nothing and fails); loaded dense, the model equals the one that trained it exactly."""
    path, _ = cross_trained_adapters[train_q]
    idx = random_tokens(2, 10, seed=10)
    adapter = Adapter.load(path, lora_llama.config)
    assert adapter.train["quantize"] == train_q
    dense_base = load_model(lora_llama.folder, precision="32-true")(idx)
    expected = load_model_with_adapter(lora_llama.folder, adapter, precision="32-true")(idx) - dense_base
    assert expected.abs().max() > 0.05 * dense_base.abs().max()  # the adapter changes the model visibly
    for q in QUANTS:
        base = load_model(lora_llama.folder, precision="32-true", quantize=q)(idx)
        model = load_model_with_adapter(lora_llama.folder, adapter, precision="32-true", quantize=q)
        got = model(idx) - base
        err = float((got - expected).abs().max() / expected.abs().max())
        assert err <= (1e-6 if q is None else TOLERANCE[q]), (q, err)
        if train_q is None and q is None:
            assert torch.equal(model(idx), cross_trained_adapters[None][1](idx))
    captured = capfd.readouterr()
    assert "Unexpected key" not in captured.out + captured.err


# ---- files written by an earlier version ---------------------------------------------------------
FIXTURES = Path(__file__).parent / "fixtures" / "adapter_v1"


@pytest.mark.parametrize("name", ["lit_model_lora_finetuned.pth", "iter-000002.pth"])
@torch.no_grad()
def test_adapter_files_of_the_first_format_still_load(name, tmp_path):
    """tests/fixtures/adapter_v1 holds a final adapter and a resumable checkpoint written by finetune/lora.py before
    the Adapter type existed (tiny Llama, nf4-dq, LoRA r=4 on every target, 2 iterations). They load through
    Adapter.load, and a model built with them computes what the base does with the updates added by hand from the raw
    tensors in the file."""
    raw = torch.load(FIXTURES / name, map_location="cpu", weights_only=False)
    config = Config.from_dict(raw["model_config"])
    adapter = Adapter.load(FIXTURES / name, config)
    # every field it has as written; the variant fields added since (rslora, ...) at their defaults: plain LoRA
    assert asdict(adapter.config) == {**asdict(LoRAConfig()), **raw["lora_config"]}
    assert adapter.train["quantize"] == "bnb.nf4-dq"
    assert any(float(v.abs().max()) > 0 for k, v in raw["lora"].items() if k.endswith("lora_B"))
    base = tmp_path / "base"
    write_random_checkpoint(base, config, seed=3, std=0.1)
    idx = random_tokens(2, 10, seed=11)
    got = load_model_with_adapter(base, adapter, precision="32-true")(idx)

    reference = load_model(base, precision="32-true")
    r, scale = raw["lora_config"]["r"], raw["lora_config"]["alpha"] / raw["lora_config"]["r"]
    for key in {k.rsplit(".", 1)[0] for k in raw["lora"]}:  # every target is on: B @ A over all rows, per part
        A, B = raw["lora"][key + ".lora_A"], raw["lora"][key + ".lora_B"]
        weight = reference.get_submodule(key).weight
        if key.endswith("attn.qkv"):  # q, k, v each with its own A (r rows) and B (its output rows)
            rows = [config.n_head * config.head_size] + [config.n_query_groups * config.head_size] * 2
            starts = [0, rows[0], rows[0] + rows[1]]
            for i, (start, n) in enumerate(zip(starts, rows)):
                weight[start:start + n] += scale * B[start:start + n] @ A[i * r:(i + 1) * r]
        else:
            weight += scale * B @ A
    torch.testing.assert_close(got, reference(idx), atol=1e-5, rtol=0)
    if name.startswith("iter-"):  # a resumable checkpoint: finetune --resume reads its state
        path, state = find_resume(tmp_path, str(FIXTURES / name))
        assert state["resume"]["step"] == 2 and state["resume"]["settings"]["quantize"] == "bnb.nf4-dq"
