"""generate/batch.py: every row of a data file through the batched engine, checked row by row against what
generate/lora.py prints for the same prompt and flags (its batch-1 path is the reference), resumed after a kill,
and with rows that cannot run written as errors while the others go on."""
from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest
import torch
from helpers import make_tiny_hf_model
from helpers_chat import load_template, make_chat_checkpoint

from lit_qlora.adapter import Adapter
from lit_qlora.convert import convert_hf_checkpoint
from lit_qlora.loader import load_model
from lit_qlora.lora import LoRAConfig, lora_modules
from lit_qlora.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["Tell me a joke about robots", "Why is the sky blue?", "Name three fruits", "Hello", "Count to five"]
FLAGS = dict(quantize="bnb.nf4", precision="32-true", max_new_tokens=12)


def _adapter(folder: Path, path: Path, lora: LoRAConfig, seed: int) -> None:
    model = load_model(folder, precision="32-true", lora=lora, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in lora_modules(model).values():  # strong enough to change the greedy text
            m.lora_A.copy_(torch.randn(m.lora_A.shape, generator=g) * 0.5)
            m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * 0.5)
    Adapter.of_model(model, lora, train=dict(template="chat", quantize="bnb.nf4", quantize_lm_head=False)).save(path)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("batch") / "tiny-chat"
    make_chat_checkpoint("gemma", folder, load_template("gemma_it"))
    tok = Tokenizer(folder)
    make_tiny_hf_model("llama", folder, vocab_size=tok.vocab_size, initializer_range=0.2,
                       bos_token_id=tok.bos_id, eos_token_id=tok.eos_id)
    convert_hf_checkpoint(folder)
    adapters = {n: folder.parent / f"{n}.pth" for n in ("alpha", "beta")}
    _adapter(folder, adapters["alpha"], LoRAConfig(r=4, alpha=8, dropout=0.0, query=True, value=True), 1)
    _adapter(folder, adapters["beta"], LoRAConfig(r=8, alpha=16, dropout=0.0, projection=True, mlp=True), 2)
    return folder, adapters


def write_rows(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def batch(**kw) -> None:
    runpy.run_path(str(ROOT / "generate" / "batch.py"))["main"](**kw)


def lora_text(capsys, folder: Path, lora_path: Path, prompt: str, **kw) -> list[str]:
    """What generate/lora.py prints for `prompt`: one text per sample (a text may hold a newline itself)."""
    capsys.readouterr()
    runpy.run_path(str(ROOT / "generate" / "lora.py"))["main"](checkpoint_dir=folder, lora_path=lora_path,
                                                               prompt=prompt, **{**FLAGS, **kw})
    return capsys.readouterr().out


def read_out(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_each_row_is_what_generate_lora_prints(chat_model, tmp_path, capsys):
    """Prompt rows, Alpaca rows and one-turn messages rows with one adapter (merged, generate/lora.py's default), and
    two samples per row with a seed: each row's text is generate/lora.py's output for it; token counts and finish
    reasons come with it."""
    folder, adapters = chat_model
    rows = [{"prompt": p, "id": i} for i, p in enumerate(PROMPTS[:3])]
    rows += [{"instruction": PROMPTS[3]}, {"messages": [{"role": "user", "content": PROMPTS[4]}]}]
    data = write_rows(tmp_path / "in.jsonl", rows)
    batch(data_dir=data, out_file=tmp_path / "out.jsonl", checkpoint_dir=folder, lora_path=[str(adapters["alpha"])],
          **FLAGS)
    out = read_out(tmp_path / "out.jsonl")
    assert [r["row"] for r in out] == [1, 2, 3, 4, 5] and [r.get("id") for r in out[:3]] == [0, 1, 2]
    for r, prompt in zip(out, PROMPTS):
        assert r["generated"] + "\n" == lora_text(capsys, folder, adapters["alpha"], prompt), r
        assert r["finish_reason"] in ("stop", "length") and 0 < r["completion_tokens"] <= 12 < r["prompt_tokens"] + 12
    data = write_rows(tmp_path / "two.jsonl", [{"prompt": p} for p in PROMPTS[:2]])
    batch(data_dir=data, out_file=tmp_path / "two_out.jsonl", checkpoint_dir=folder, lora_path=[str(adapters["beta"])],
          num_samples=2, temperature=1.2, seed=5, **FLAGS)
    for r, prompt in zip(read_out(tmp_path / "two_out.jsonl"), PROMPTS):
        assert len(r["generated"]) == 2 and r["generated"][0] != r["generated"][1]
        assert "".join(t + "\n" for t in r["generated"]) == lora_text(capsys, folder, adapters["beta"], prompt,
                                                                      num_samples=2, temperature=1.2, seed=5)


def test_adapter_per_row_bad_rows_and_resume(chat_model, tmp_path, capsys):
    """Named adapters, each row picking its own (none: the base), all unmerged over one 4-bit base in the same steps:
    each row is generate/lora.py --merge false's text for its adapter (a row without one: generate/base.py's). A row
    naming an unknown adapter, a row that is not an object, a prompt that is not text and one too long for the model
    each get an error line and the rest go on. A run killed after three rows (its last line cut off) is continued by
    a rerun: the rows written stay as they were, the others are added, and the result is the uninterrupted run's."""
    folder, adapters = chat_model
    rows = [{"prompt": PROMPTS[0], "adapter": "alpha"}, {"prompt": PROMPTS[1]},
            {"prompt": PROMPTS[2], "adapter": "beta"}, {"prompt": PROMPTS[3], "adapter": "gamma"}, [1, 2],
            {"prompt": 5}, {"prompt": "word " * 200}, {"prompt": PROMPTS[4], "adapter": "alpha"}]
    data = write_rows(tmp_path / "in.jsonl", rows)
    named = [f"{n}={p}" for n, p in adapters.items()]
    full = tmp_path / "full.jsonl"
    batch(data_dir=data, out_file=full, checkpoint_dir=folder, lora_path=named, **FLAGS)
    out = read_out(full)
    assert [r["row"] for r in out] == list(range(1, 9))
    assert "names the adapter 'gamma', which is not one of --lora_path's (alpha, beta)" in out[3]["error"]
    assert "is a list, not an object" in out[4]["error"] and out[4]["input"] == [1, 2]
    assert '"prompt" is a number (5), not text' in out[5]["error"]
    assert "exceed the model's context" in out[6]["error"]
    base = runpy.run_path(str(ROOT / "generate" / "base.py"))["main"]
    capsys.readouterr()
    base(checkpoint_dir=folder, prompt=PROMPTS[1], quantize="bnb.nf4", precision="32-true", max_new_tokens=12)
    assert out[1]["generated"] + "\n" == capsys.readouterr().out  # the base: the raw prompt, as generate/base.py
    for i, name in [(0, "alpha"), (2, "beta"), (7, "alpha")]:
        prompt = rows[i]["prompt"]
        assert out[i]["generated"] + "\n" == lora_text(capsys, folder, adapters[name], prompt, merge=False), i
    # killed after three rows, the last line half written
    lines = full.read_text().splitlines(keepends=True)
    cut = tmp_path / "cut.jsonl"
    cut.write_text("".join(lines[:3]) + lines[3][:10])
    batch(data_dir=data, out_file=cut, checkpoint_dir=folder, lora_path=named, **FLAGS)
    assert cut.read_text() == full.read_text()
    assert "8 rows in" in capsys.readouterr().err


def test_reads_every_record_format(chat_model, tmp_path):
    """The same rows as .jsonl, .csv and .parquet (the one record reader) give the same output; a data folder too."""
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    folder, adapters = chat_model
    frame = pd.DataFrame({"prompt": PROMPTS[:3]})
    outs = []
    for name in ("rows.jsonl", "rows.csv", "rows.parquet"):
        path = tmp_path / name
        if name.endswith("jsonl"):
            frame.to_json(path, orient="records", lines=True)
        elif name.endswith("csv"):
            frame.to_csv(path, index=False)
        else:
            frame.to_parquet(path)
        out = tmp_path / f"{name}.out.jsonl"
        batch(data_dir=path, out_file=out, checkpoint_dir=folder, **FLAGS)
        outs.append([r["generated"] for r in read_out(out)])
    assert outs[0] == outs[1] == outs[2] and len(outs[0]) == 3
