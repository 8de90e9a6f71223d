"""finetune/dpo.py end to end, as real subprocesses on the tiny Llama of helpers_train (no mocks): a bnb.nf4 run
whose first DPO loss is ln 2 and whose reference is the quantized base without the adapter, a resumed run equal to
the uninterrupted one, the adapter in generate/lora.py and in PEFT, a run from an SFT adapter (its reference is
that adapter), --strategy fsdp on two CPU processes equal to one process (and resumed), --data_sources mixtures of
pair sources (proportions, seed, resume), and the bad inputs refused in one line with nothing written."""
from __future__ import annotations

import csv
import json
import math
import random
import shutil

import helpers_train as h
import pytest
import torch
from helpers_bounds import SEQUENCES, assert_logits_as_close_as

from lit_qlora.adapter import Adapter
from lit_qlora.data.prepare import DataSettings
from lit_qlora.loader import load_model
from lit_qlora.tokenizer import Tokenizer
from lit_qlora.train import preference as pf

DPO = h.ROOT / "finetune" / "dpo.py"
REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")
RUN = dict(max_iters=8, save_interval=4, keep_checkpoints=0, eval_interval=4, micro_batch_size=4, batch_size=4,
           learning_rate=1e-2, lora_dropout=0.1, quantize="bnb.nf4", lora_mlp=True)


def make_pairs(n: int = 40, seed: int = 0) -> list[dict]:
    """Say the kind of a word (helpers_train's task): the right kind chosen, a wrong one rejected."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        kind = rng.choice(list(h.KINDS))
        wrong = rng.choice([k for k in h.KINDS if k != kind])
        rows.append({"prompt": f"kind {rng.choice(h.KINDS[kind])}", "chosen": f" {kind}", "rejected": f" {wrong}"})
    return rows


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    s = dict(h.tiny_setup(tmp_path_factory))
    pairs = tmp_path_factory.mktemp("pairs")
    (pairs / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in make_pairs()))
    return {**s, "data": pairs}


def dpo_args(setup, out, **kw) -> list[str]:
    return h.train_args(setup, out, **{"eval_max_new_tokens": None, **kw})


def run_dpo(setup, out, check=True, timeout=180, **kw):
    r = h.run_script(DPO, dpo_args(setup, out, **kw), timeout=timeout)
    if check:
        assert r.returncode == 0, f"exit {r.returncode}\n{r.stderr}"
    return r


@pytest.fixture(scope="module")
def nf4_run(setup, tmp_path_factory):
    out = tmp_path_factory.mktemp("dpo") / "A"
    run_dpo(setup, out, **RUN)
    return out


def test_nf4_run_starts_at_ln2_and_logs_trl_rewards(nf4_run):
    rows = h.read_metrics(nf4_run)
    assert [int(r["iter"]) for r in rows] == list(range(1, 9))
    assert abs(float(rows[0]["loss"]) - math.log(2)) < 1e-5  # policy = reference: the first loss is ln 2
    for k in REWARDS:
        assert all(r[k] != "" for r in rows), k
    assert float(rows[0]["rewards/margins"]) == 0.0
    assert any(float(r["rewards/margins"]) != 0 for r in rows[1:])  # the policy moved away from the reference
    assert rows[3]["val_loss"] and rows[3]["val_rewards/accuracies"]
    train = Adapter.load(nf4_run / "lit_model_lora_finetuned.pth").train
    assert train["objective"] == "dpo" and train["quantize"] == "bnb.nf4"


def test_reference_is_the_base_without_the_adapter(setup, nf4_run):
    """reference_logps.pt holds what the nf4 base alone (no LoRA layers at all) gives every training pair."""
    tok = Tokenizer(setup["ckpt"])
    train, _, _ = pf.load_pairs(setup["data"], tok, DataSettings(128, template="plain"))
    base = load_model(setup["ckpt"], precision="32-true", quantize="bnb.nf4").eval()
    with torch.no_grad():
        lp = pf.batch_logps(base, pf.collate_pairs(train, pad_id=tok.eos_id))
    ref = torch.load(nf4_run / "reference_logps.pt")["train"]
    torch.testing.assert_close(ref, torch.stack([lp.chosen, lp.rejected], 1), atol=1e-4, rtol=1e-5)


def test_resumed_run_equals_uninterrupted(setup, nf4_run, tmp_path):
    """B is A's folder as it stood at iteration 4 (later checkpoints and results removed), resumed."""
    b = tmp_path / "B"
    shutil.copytree(nf4_run, b)
    (b / "checkpoints" / "iter-000008.pth").unlink()
    for f in ("lit_model_lora_finetuned.pth", "metrics.json"):
        (b / f).unlink()
    run_dpo(setup, b, resume="true", **RUN)
    la, lb = h.losses_by_iter(nf4_run), h.losses_by_iter(b)
    assert sorted(la) == sorted(lb) == list(range(1, 9))
    for i in range(5, 9):
        assert abs(la[i] - lb[i]) <= 1e-6, (i, la[i], lb[i])
    final = "lit_model_lora_finetuned.pth"
    assert h.max_abs_diff(h.load_lora(nf4_run / final), h.load_lora(b / final)) < 1e-6


def test_adapter_generates_and_exports_to_peft(setup, nf4_run, tmp_path):
    from helpers import hf_model
    from peft import PeftModel

    adapter_file = nf4_run / "lit_model_lora_finetuned.pth"
    r = h.run_script(h.GENERATE_LORA, ["--checkpoint_dir", setup["ckpt"], "--lora_path", adapter_file, "--prompt",
                                       "kind", "--input", "cat", "--max_new_tokens", 3])
    assert r.returncode == 0, r.stderr
    adapter = Adapter.load(adapter_file)
    model = load_model(setup["ckpt"], precision="32-true", lora=adapter.config)
    adapter.load_into(model)
    adapter.export_peft(model.config, tmp_path / "peft", base_model_name_or_path=str(setup["ckpt"]))
    idx = torch.randint(0, h.VOCAB, (SEQUENCES, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        peft_model = PeftModel.from_pretrained(hf_model(setup["ckpt"]), tmp_path / "peft").eval()
        assert_logits_as_close_as(model.eval()(idx), peft_model, idx, "against PEFT")


def test_from_an_sft_adapter_the_reference_is_that_adapter(setup, tmp_path):
    """IPO from an SFT adapter: at the first step policy = reference = base + adapter, so the loss is
    (0 - 1 / (2 beta))^2 = 1 for beta 0.5; had the reference been the base, it would not be."""
    from helpers import randomize_lora

    from lit_qlora.lora import LoRAConfig

    lora = LoRAConfig(r=4, alpha=8, dropout=0.0, query=True, value=True, mlp=True)
    model = load_model(setup["ckpt"], precision="32-true", lora=lora, seed=0)
    randomize_lora(model, seed=5)
    sft = tmp_path / "sft.pth"
    Adapter.of_model(model, lora).save(sft)
    out = tmp_path / "out"
    run_dpo(setup, out, max_iters=2, loss="ipo", beta=0.5, lora_path=sft, lora_r=16)
    rows = h.read_metrics(out)
    assert abs(float(rows[0]["loss"]) - 1.0) < 1e-5, rows[0]["loss"]
    trained = Adapter.load(out / "lit_model_lora_finetuned.pth")
    assert trained.config == lora  # the SFT adapter's settings, not --lora_r 16
    tok = Tokenizer(setup["ckpt"])
    train, _, _ = pf.load_pairs(setup["data"], tok, DataSettings(128, template="plain"))
    with torch.no_grad():
        lp = pf.batch_logps(model.eval(), pf.collate_pairs(train[:4], pad_id=tok.eos_id))
    ref = torch.load(out / "reference_logps.pt")["train"][:4]
    torch.testing.assert_close(ref, torch.stack([lp.chosen, lp.rejected], 1), atol=1e-4, rtol=1e-5)


def style_pairs(seed: int = 0) -> tuple[list[dict], list[dict]]:
    """A preference a tiny model can learn and carry to prompts it was not trained on: answer with a color rather
    than an animal (helpers_train's words). Each prompt names one word and gets two pairs, a random color chosen and
    a random animal rejected; the held-out pairs are those of a third of the words, so no held-out prompt is trained
    on. Before training, which answer the random base prefers is chance."""
    rng = random.Random(seed)
    words = [w for ws in h.KINDS.values() for w in ws]
    rng.shuffle(words)
    rows = {w: [{"prompt": f"a word after {w}", "chosen": f" {rng.choice(h.KINDS['color'])}",
                 "rejected": f" {rng.choice(h.KINDS['animal'])}"} for _ in range(2)] for w in words}
    n_val = len(words) // 3
    return [r for w in words[n_val:] for r in rows[w]], [r for w in words[:n_val] for r in rows[w]]


def test_held_out_preference_accuracy_rises(setup, tmp_path):
    """DPO on a bnb.nf4 base, 44 training pairs (style_pairs): on the 22 held-out pairs (prompts never trained on)
    the share whose chosen answer the model gives the higher log-probability goes from chance (the random base) to
    nearly all, and the reward
    accuracy (TRL's val_rewards/accuracies: chosen's log-ratio above rejected's) from 0 (policy = reference: ties)
    to nearly all, with the held-out loss below ln 2."""
    train, val = style_pairs()
    data = tmp_path / "pairs"
    data.mkdir()
    for name, rows in (("train.jsonl", train), ("val.jsonl", val)):
        (data / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    run_dpo(setup, out, data_dir=data, max_iters=20, micro_batch_size=8, batch_size=8, learning_rate=1e-2,
            eval_interval=20, eval_iters=5, save_interval=20, quantize="bnb.nf4", lora_mlp=True, lora_head=True,
            timeout=600)
    with open(out / "metrics.csv") as f:  # (h.read_metrics leaves out row 0, the starting validation)
        vals = [r for r in csv.DictReader(f) if r["val_loss"]]
    first, last = vals[0], vals[-1]
    assert int(first["iter"]) == 0 and int(last["iter"]) == 20
    assert float(first["val_rewards/accuracies"]) == 0.0 and abs(float(first["val_loss"]) - math.log(2)) < 1e-5
    ref = torch.load(out / "reference_logps.pt")["val"]  # the base's held-out log-probabilities
    before = float((ref[:, 0] > ref[:, 1]).float().mean())
    tok = Tokenizer(setup["ckpt"])
    _, held_out, _ = pf.load_pairs(data, tok, DataSettings(128, template="plain"))
    adapter = Adapter.load(out / "lit_model_lora_finetuned.pth")
    model = load_model(setup["ckpt"], precision="32-true", quantize="bnb.nf4", lora=adapter.config)
    adapter.load_into(model)
    with torch.no_grad():
        lp = pf.batch_logps(model.eval(), pf.collate_pairs(held_out, pad_id=tok.eos_id))
    after = float((lp.chosen > lp.rejected).float().mean())
    accuracy = float(last["val_rewards/accuracies"])
    print(f"held-out ({len(held_out)}): log p(chosen) > log p(rejected) {before:.3f} -> {after:.3f}; reward "
          f"accuracy 0 -> {accuracy:.3f}, loss {float(first['val_loss']):.3f} -> {float(last['val_loss']):.3f}")
    assert 0.2 <= before <= 0.8
    assert after >= 0.9 and accuracy >= 0.9 and float(last["val_loss"]) < 0.5


def write_bad(folder, rows):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


@pytest.mark.parametrize("case", ["same", "missing", "long_prompt", "other_base", "packing", "loss", "sources"])
def test_bad_input_is_one_line_and_writes_nothing(setup, tmp_path, capsys, case):
    good = make_pairs(6)
    kw, expect = {}, ()
    data = setup["data"]
    if case == "same":
        data = write_bad(tmp_path / "d", [*good[:2], {"prompt": "kind cat", "chosen": " x", "rejected": " x"}])
        expect = "row 3 of", "chosen and rejected are the same"
    elif case == "missing":
        data = write_bad(tmp_path / "d", [*good[:1], {"prompt": "kind cat", "chosen": " x"}])
        expect = "row 2 of", "has no 'rejected' field"
    elif case == "long_prompt":
        data = write_bad(tmp_path / "d", [*good[:3], {"prompt": "kind " * 200, "chosen": " a", "rejected": " b"}])
        expect = "row 4 of", "the prompt is", "--max_seq_length 64"
    elif case == "other_base":
        from helpers import make_tiny_hf_model

        from lit_qlora.convert import ensure_converted
        from lit_qlora.lora import LoRAConfig

        other = tmp_path / "other"
        make_tiny_hf_model("llama", other, vocab_size=h.VOCAB, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=1)
        ensure_converted(other, quiet=True)
        lora = LoRAConfig(r=2, alpha=4)
        Adapter.of_model(load_model(other, precision="32-true", lora=lora), lora).save(tmp_path / "other.pth")
        kw, expect = dict(lora_path=tmp_path / "other.pth"), ("was trained on",)
    elif case == "sources":  # a --data_sources entry of instruction records, not pairs
        data = tmp_path / "sft"
        data.mkdir()
        (data / "train.json").write_text(json.dumps(h.make_records(8)))
        (tmp_path / "mix.json").write_text(json.dumps([{"path": str(setup["data"]), "weight": 1},
                                                       {"path": str(data), "weight": 1}]))
        kw = dict(data_dir=None, data_sources=tmp_path / "mix.json")
        expect = f"row 1 of {data / 'train.json'}", "has no 'prompt' field"
    elif case == "packing":
        kw, expect = dict(packing="true"), ("--packing",)
    else:
        kw, expect = dict(loss="kto"), ("--loss",)
    before = h.snapshot(data)
    out = tmp_path / "out"
    capsys.readouterr()  # (what building the other model printed)
    code = run_here(dpo_args(setup, out, **{"data_dir": data, "max_seq_length": 64, **kw}))
    err = capsys.readouterr().err
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and all(e in lines[0] for e in expect), err
    assert not out.exists() or not any(out.iterdir())  # (as finetune/lora.py: at most the empty --out_dir)
    assert h.snapshot(data) == before


def run_here(argv: list) -> int:
    """finetune/dpo.py's CLI in this process (the refusals come before any model is loaded); its exit code."""
    import runpy
    import sys

    saved = sys.argv
    sys.argv = [str(DPO), *map(str, argv)]
    try:
        runpy.run_path(str(DPO), run_name="__main__")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
    finally:
        sys.argv = saved
    return 0


# ---- FSDP: two processes, each holding half the base ---------------------------------------------------------------
FSDP_RUN = dict(max_iters=6, save_interval=3, keep_checkpoints=0, eval_interval=3, eval_iters=2, batch_size=4,
                learning_rate=1e-3, lora_dropout=0.0, quantize="bnb.nf4", lora_mlp=True, accelerator="cpu")


def _final_columns(out) -> dict[int, dict]:
    """metrics.csv's loss, rewards and validation figures by iteration."""
    keys = ("loss", *REWARDS, "val_loss", *(f"val_{k}" for k in REWARDS))
    return {int(r["iter"]): {k: float(r[k]) for k in keys if r.get(k)} for r in h.read_metrics(out)}


def _assert_same_run(a, b, tol: float = 1e-5) -> None:
    ra, rb = _final_columns(a), _final_columns(b)
    assert sorted(ra) == sorted(rb) == list(range(1, FSDP_RUN["max_iters"] + 1)), (ra, rb)
    for i in ra:
        assert ra[i].keys() == rb[i].keys() and all(abs(ra[i][k] - rb[i][k]) <= tol for k in ra[i]), (i, ra[i], rb[i])
    final = "lit_model_lora_finetuned.pth"
    assert h.max_abs_diff(h.load_lora(a / final), h.load_lora(b / final)) < tol


@pytest.mark.parametrize("loss", ["dpo", "orpo"])
def test_fsdp_equals_one_process(setup, tmp_path, loss):
    """--strategy fsdp on two CPU processes (gloo), each holding half of the bnb.nf4 base: the reference pass, the
    steps and validation (one held-out batch: the second process has none and still takes part in every forward)
    give the losses, rewards and adapter of one process on the same global batch (fp32, 1e-5). dpo: the reference
    log-probabilities are the one process's, and a run resumed at iteration 3 under FSDP ends where the
    uninterrupted ones did; orpo starts from an SFT adapter (--lora_path: each process takes its shard of it)."""
    kw = dict(FSDP_RUN, loss=loss)
    if loss == "orpo":
        from helpers import randomize_lora

        from lit_qlora.lora import LoRAConfig

        lora = LoRAConfig(r=4, alpha=8, dropout=0.0, query=True, value=True, mlp=True)
        model = load_model(setup["ckpt"], precision="32-true", lora=lora, seed=0)
        randomize_lora(model, seed=5)
        Adapter.of_model(model, lora).save(tmp_path / "sft.pth")
        kw.update(lora_path=tmp_path / "sft.pth")
    one, two = tmp_path / "one", tmp_path / "fsdp"
    run_dpo(setup, one, micro_batch_size=4, **kw)
    r = run_dpo(setup, two, micro_batch_size=2, devices=2, strategy="fsdp", timeout=300, **kw)
    assert "this rank holds" in r.stderr, r.stderr
    summary = json.loads((two / "metrics.json").read_text())
    assert summary["strategy"] == "fsdp" and summary["devices"] == 2
    _assert_same_run(one, two)
    if loss != "dpo":
        return
    ref_one, ref_two = (torch.load(x / "reference_logps.pt") for x in (one, two))
    for k in ("train", "val"):
        torch.testing.assert_close(ref_two[k], ref_one[k], atol=1e-5, rtol=0)
    c = tmp_path / "resumed"
    shutil.copytree(two, c)
    (c / "checkpoints" / "iter-000006.pth").unlink()
    for f in ("lit_model_lora_finetuned.pth", "metrics.json"):
        (c / f).unlink()
    r = run_dpo(setup, c, micro_batch_size=2, devices=2, strategy="fsdp", resume="true", timeout=300, **kw)
    assert f"Resuming from {c / 'checkpoints/iter-000003.pth'} at iteration 3" in r.stderr, r.stderr
    _assert_same_run(one, c)


# ---- --data_sources: mixtures of preference sources, through finetune/lora.py's mixing -------------------------------
def _write_pairs(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _dpo_module():
    import importlib.util
    import sys

    if "finetune_dpo" not in sys.modules:
        spec = importlib.util.spec_from_file_location("finetune_dpo", DPO)
        sys.modules["finetune_dpo"] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules["finetune_dpo"]


def test_a_mixture_of_pair_sources_keeps_its_proportions_and_seed(setup, tmp_path):
    """finetune/dpo.py's load_data with --data_sources: three sources of 40 distinct pairs (38 trained, 2 held out
    each) at 175 / 50 / 25 epochs make 9500 pairs in the shares 0.7 / 0.2 / 0.1 exactly, their first half within 2%;
    the same seed gives the same sequence, another seed another; every place is numbered once (a pair that comes
    several times has one reference log-probability per place)."""
    from lit_qlora.args import parse_finetune_args
    from lit_qlora.config import Config

    dpo = _dpo_module()
    tok = Tokenizer(setup["ckpt"])
    config = Config.from_file(setup["ckpt"] / "model_config.json")
    epochs = {"a": 175, "b": 50, "c": 25}
    kinds = {}
    for name in epochs:
        rows = [dict(r, prompt=f"{name} {i} {r['prompt']}") for i, r in enumerate(make_pairs(40, seed=ord(name)))]
        _write_pairs(tmp_path / f"{name}.jsonl", rows)
        train, _, _ = pf.load_pairs(tmp_path / f"{name}.jsonl", tok, DataSettings(64, template="plain"))
        kinds.update({tuple(p["chosen_ids"].tolist()): name for p in train})
    (tmp_path / "mix.yaml").write_text("".join(f"- {{path: {n}.jsonl, epochs: {e}}}\n" for n, e in epochs.items()))

    def load(seed: int):
        args = parse_finetune_args(dpo_args(setup, tmp_path / "out", data_dir=None, data_sources=tmp_path / "mix.yaml",
                                            max_seq_length=64, seed=seed), preference=True)
        return dpo.load_data(args, tok, config, 64)

    train, val, meta = load(3)
    names = [kinds[tuple(p["chosen_ids"].tolist())] for p in train]
    assert len(train) == 9500 and len(val) == 6 and [m["used"] for m in meta["mixture"]] == [6650, 1900, 950]
    for name, share in (("a", 0.7), ("b", 0.2), ("c", 0.1)):
        assert names.count(name) / 9500 == pytest.approx(share)
        assert abs(names[:4750].count(name) / 4750 - share) <= 0.02, name
    assert [p["index"] for p in train] == list(range(9500)) and [p["index"] for p in val] == list(range(6))
    ids = [p["chosen_ids"].tolist() for p in train]
    assert [p["chosen_ids"].tolist() for p in load(3)[0]] == ids
    assert [p["chosen_ids"].tolist() for p in load(4)[0]] != ids


def test_a_mixture_of_pairs_trains_reports_and_resumes(setup, tmp_path):
    """finetune/dpo.py --data_sources (the pairs folder by weight, another file twice): the realized mixture in
    metrics.json, the first loss ln 2 (each place in the mixture looks up its own reference), and a run resumed from
    its iteration-2 checkpoint retraces the uninterrupted one (the same mixed sequence, LoRA dropout on)."""
    _write_pairs(tmp_path / "other.jsonl", make_pairs(20, seed=9))
    (tmp_path / "mix.json").write_text(json.dumps([{"path": str(setup["data"]), "weight": 1},
                                                   {"path": "other.jsonl", "epochs": 2}]))
    common = dict(data_dir=None, data_sources=tmp_path / "mix.json", max_iters=4, save_interval=2, keep_checkpoints=0,
                  eval_interval=4, micro_batch_size=4, batch_size=4, learning_rate=1e-2, lora_dropout=0.1)
    a = tmp_path / "a"
    run_dpo(setup, a, **common)
    mixture = json.loads((a / "metrics.json").read_text())["data_mixture"]
    assert [(m["available"], m["used"]) for m in mixture] == [(38, 38), (19, 38)]  # 5% of each held out
    assert len(torch.load(a / "reference_logps.pt")["train"]) == 76
    assert abs(h.losses_by_iter(a)[1] - math.log(2)) < 1e-5  # each place's own reference: policy = reference
    b = tmp_path / "b"
    (b / "checkpoints").mkdir(parents=True)
    for f in ("checkpoints/iter-000002.pth", "reference_logps.pt", "metrics.csv"):
        shutil.copy(a / f, b / f)
    run_dpo(setup, b, resume="true", **common)
    la, lb = h.losses_by_iter(a), h.losses_by_iter(b)
    assert sorted(lb) == [1, 2, 3, 4] and all(abs(la[i] - lb[i]) <= 1e-6 for i in (3, 4)), (la, lb)
    final = "lit_model_lora_finetuned.pth"
    assert h.max_abs_diff(h.load_lora(a / final), h.load_lora(b / final)) < 1e-6
