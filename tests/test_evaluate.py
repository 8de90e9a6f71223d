"""scripts/evaluate.py and lit_qlora.train.evaluate.LitLM against lm-evaluation-harness's own Hugging Face backend.

Three local tasks (YAMLs + a JSON data file written here; nothing downloads, HF_DATASETS_OFFLINE=1), one per request
type: multiple choice (loglikelihood), perplexity (loglikelihood_rolling) and generation (generate_until). lm-eval's
HFLM over the tiny transformers model and our LM over its conversion give the same per-sample responses (each
choice's log-likelihood within 1e-3, the same generated text) and the same metrics; the script writes lm-eval's files;
an adapter fine-tuned on the task scores differently from the base.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import helpers_train as h
import pytest
import torch
from helpers import run_script_here

pytest.importorskip("lm_eval")
os.environ["HF_DATASETS_OFFLINE"] = "1"

MC, ROLL, GEN = "tiny_kinds_mc", "tiny_kinds_ppl", "tiny_kinds_gen"
METRIC = "  - metric: {}\n    aggregation: mean\n    higher_is_better: true\n"


def write_tasks(folder: Path) -> Path:
    """Three task YAMLs over one local JSON file of the training task's records (as the plain template shows them)."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "kinds.json"
    records = h.make_records(12, seed=7)
    choices = sorted(h.KINDS)
    # the first text is longer than the model's context (128): scored in several windows
    data.write_text(json.dumps([{**r, "label": choices.index(r["output"]),
                                 "text": f"{r['input']} is a {r['output']}. " * (40 if i == 0 else 1)}
                                for i, r in enumerate(records)]))
    common = (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n")
    (folder / "mc.yaml").write_text(
        f"task: {MC}\n{common}output_type: multiple_choice\n"
        'doc_to_text: "{{instruction}}\\n{{input}}\\n"\n'
        f"doc_to_choice: {json.dumps(choices)}\n"
        "doc_to_target: label\nmetric_list:\n" + METRIC.format("acc") + METRIC.format("acc_norm"))
    (folder / "ppl.yaml").write_text(
        f"task: {ROLL}\n{common}output_type: loglikelihood_rolling\n"
        'doc_to_text: ""\ndoc_to_target: "{{text}}"\n'
        "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n")
    (folder / "gen.yaml").write_text(
        f"task: {GEN}\n{common}output_type: generate_until\n"
        'doc_to_text: "{{instruction}}\\n{{input}}\\n"\ndoc_to_target: "{{output}}"\n'
        'generation_kwargs:\n  until: ["\\n", ","]\n  max_gen_toks: 8\n  do_sample: false\n'
        "metric_list:\n" + METRIC.format("exact_match"))
    return folder


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    return write_tasks(tmp_path_factory.mktemp("lm_eval_tasks"))


def evaluate(lm, tasks: Path) -> dict:
    from lit_qlora.train.evaluate import run_tasks

    return run_tasks(lm, [MC, ROLL, GEN], tasks, log_samples=True)


@pytest.fixture(scope="module")
def reference(train_setup, tasks):
    """lm-eval's HFLM over the tiny transformers model itself (fp32)."""
    from lm_eval.models.huggingface import HFLM

    torch.manual_seed(0)
    return evaluate(HFLM(pretrained=str(train_setup["ckpt"]), device="cpu", dtype="float32", batch_size=4), tasks)


def ours(ckpt: Path, lora_path=None, batch_size: int = 3):
    from lit_qlora.inference import load_for_inference
    from lit_qlora.train.evaluate import LitLM

    device = torch.device("cpu")
    model, tokenizer, _ = load_for_inference(ckpt, lora_path, None, "32-true", device)
    return LitLM(model, tokenizer, device, "32-true", batch_size=batch_size)


def responses(results: dict, task: str) -> list:
    return [s["resps"] for s in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


def test_scores_equal_lm_evals_hf_backend(train_setup, tasks, reference):
    got = evaluate(ours(train_setup["ckpt"]), tasks)
    for task in (MC, ROLL):
        ref, res = responses(reference, task), responses(got, task)
        assert len(ref) == len(res) == 12
        n = 0
        for a, b in zip(ref, res):
            assert len(a) == len(b)
            for (ra,), (rb,) in zip(a, b):  # one response per request: (loglikelihood, is_greedy) or a float
                ra, rb = (ra, rb) if task == ROLL else (ra[0], rb[0])
                assert abs(ra - rb) <= 1e-3, (task, ra, rb)
                n += 1
        assert n == 12 * (3 if task == MC else 1)
    assert responses(got, GEN) == responses(reference, GEN)  # the same greedy text, stopped at the same "\n"
    for task in (MC, ROLL, GEN):
        for metric, value in reference["results"][task].items():
            if isinstance(value, float):
                assert got["results"][task][metric] == pytest.approx(value, rel=1e-4, abs=1e-6), (task, metric)


def test_batching_does_not_change_scores(train_setup, tasks, reference):
    """One sequence per forward pass against several (padded on the right): the same log-likelihoods."""
    got = evaluate(ours(train_setup["ckpt"], batch_size=1), tasks)
    for a, b in zip(responses(reference, MC), responses(got, MC)):
        assert max(abs(x[0][0] - y[0][0]) for x, y in zip(a, b)) <= 1e-3


def test_script_writes_results_and_adapter_scores_differently(train_setup, trained_run, tasks, tmp_path):
    adapter = trained_run[0] / "lit_model_lora_finetuned.pth"
    scores = {}
    for name, extra in (("base", []), ("tuned", ["--lora_path", adapter])):
        out = tmp_path / name
        assert run_script_here("evaluate.py", "--checkpoint_dir", train_setup["ckpt"], *extra, "--tasks",
                               f"{MC},{GEN}", "--include_path", tasks, "--precision", "32-true", "--out_dir", out,
                               "--limit", 8, "--log_samples", "true", "--accelerator", "cpu") == 0
        results = json.loads((out / "results.json").read_text())
        assert "| " + MC in (out / "results.md").read_text().replace("|" + MC, "| " + MC)
        samples = sorted((out / "lit-qlora").glob(f"samples_{MC}_*.jsonl"))
        assert len(samples) == 1, list(out.rglob("*"))
        rows = [json.loads(line) for line in samples[0].read_text().splitlines()]
        assert len(rows) == 8 and all(len(r["filtered_resps"]) == 3 for r in rows)  # each choice's log-likelihood
        scores[name] = (results["results"][MC]["acc_norm,none"], [r["filtered_resps"] for r in rows])
    assert scores["tuned"][1] != scores["base"][1]  # other log-likelihoods for the same choices
    assert scores["tuned"][0] > scores["base"][0], scores  # seen: 0.625 against 0.25 (length-normalized accuracy)
