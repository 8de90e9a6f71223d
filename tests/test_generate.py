"""generate/lora.py and generate/base.py as real subprocesses, with an adapter trained_adapter by finetune/lora.py.

What is shown here:
1. greedy output with the adapter (merged on load, the default) equals the greedy output of the checkpoint written by
   scripts/merge_lora.py run through generate/base.py with the identically formatted prompt, and equals what the
   library computes in-process; unmerged LoRA layers with --stream true print the same stdout;
2. stdout holds the generated text alone; stderr ends with the speed and memory lines;
3. under every --quantize value the script prints what the library computes in-process for that quantization;
4. streaming: StreamPrinter writes each character as soon as it decodes whole (a multi-byte character held back
   until complete, a cut one written at the end) and adds up to decode() on byte-level BPE and sentencepiece;
   run_prompts --stream writes each piece between forward passes, which a print-at-the-end "stream" fails.
"""
from __future__ import annotations

import io
import json
import math
import re
import sys

import helpers_train as h
import pytest
import torch

from lit_qlora.precision import resolve_precision

PROMPT, INPUT = "kind", "owl"
FORMATTED = "kind\nowl\n"  # the "plain" template the adapter was trained_adapter with
NEW = 8
TIME_RE = r"Time for inference: \d+\.\d+ sec total, \d+\.\d+ tokens/sec"
MEM_RE = r"Memory used: \d+\.\d+ GB"


@pytest.fixture(scope="module")
def trained_adapter(tmp_path_factory):
    setup = h.tiny_setup(tmp_path_factory)
    out, _ = h.trained_run(tmp_path_factory)
    return setup, out / "lit_model_lora_finetuned.pth"


def gen_lora(setup, adapter, *extra, check=True):
    r = h.run_script(h.GENERATE_LORA, ["--checkpoint_dir", setup["ckpt"], "--lora_path", adapter, "--prompt", PROMPT,
                                        "--input", INPUT, "--max_new_tokens", NEW, *extra])
    if check:
        assert r.returncode == 0, r.stderr
    return r


def assert_figures_at_end(stderr: str) -> None:
    lines = stderr.strip().splitlines()
    assert re.fullmatch(TIME_RE, lines[-2]), lines[-3:]
    assert re.fullmatch(MEM_RE, lines[-1]), lines[-3:]


def expected_text(setup, adapter_path) -> str:
    """The greedy continuation computed in-process by the library: the adapter merged into fp32 weights."""
    from lit_qlora.adapter import Adapter
    from lit_qlora.config import Config
    from lit_qlora.generation import generate
    from lit_qlora.loader import load_model
    from lit_qlora.tokenizer import Tokenizer

    config = Config.from_file(setup["ckpt"] / "model_config.json")
    adapter = Adapter.load(adapter_path, config)
    model = load_model(setup["ckpt"], precision="32-true", merge_adapter=adapter, config=config).eval()
    tok = Tokenizer(setup["ckpt"])
    ids = tok.encode(FORMATTED)
    stops = tok.stop_ids or [tok.eos_id]
    out = generate(model, ids, NEW, eos_ids=stops)
    return tok.decode([t for t in out[len(ids):].tolist() if t not in stops])


def test_adapter_output_equals_merged_checkpoint_and_streaming(trained_adapter, tmp_path):
    setup, adapter = trained_adapter
    want = expected_text(setup, adapter)
    assert want.strip(), "the trained_adapter adapter should answer with some text"

    merged = gen_lora(setup, adapter, "--precision", "32-true")
    assert merged.stdout == want + "\n"  # the generated text alone
    assert_figures_at_end(merged.stderr)

    folder = tmp_path / "merged"
    r = h.run_script(h.MERGE, ["--checkpoint_dir", setup["ckpt"], "--lora_path", adapter, "--out_dir", folder])
    assert r.returncode == 0, r.stderr
    base = h.run_script(h.GENERATE_BASE, ["--checkpoint_dir", folder, "--prompt", FORMATTED, "--max_new_tokens", NEW,
                                          "--precision", "32-true"])
    assert base.returncode == 0, base.stderr
    assert base.stdout == merged.stdout
    assert_figures_at_end(base.stderr)

    streamed = gen_lora(setup, adapter, "--precision", "32-true", "--merge", "false", "--stream", "true")
    assert streamed.stdout == merged.stdout
    assert_figures_at_end(streamed.stderr)


AUTO = resolve_precision("auto", "cpu")[0]  # 32-true on a CPU without native bf16


def library_text(setup, adapter_path, quantize: str) -> str:
    """generate/lora.py's output as the library computes it in this process: same loading (--precision auto as the
    script resolves it here, the adapter merged before quantizing), prompt, stop ids and greedy decoding, on one
    thread as the script runs."""
    from lit_qlora.generation import generate
    from lit_qlora.inference import encode_prompt, load_for_inference

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, tok, adapter = load_for_inference(setup["ckpt"], adapter_path, quantize, AUTO, torch.device("cpu"))
        ids, stops = encode_prompt(tok, PROMPT, INPUT, adapter, None)
        out = generate(model, ids, NEW, eos_ids=stops)
    finally:
        torch.set_num_threads(threads)
    return tok.decode([t for t in out[len(ids):].tolist() if t not in stops])


@pytest.mark.parametrize("quantize", ["bnb.nf4", "bnb.nf4-dq", "bnb.fp4", "bnb.fp4-dq", "bnb.int8"])
def test_every_quantization_generates(trained_adapter, tmp_path, quantize):
    """The script's text under each --quantize is what the library computes for that quantization."""
    setup, adapter = trained_adapter
    metrics = tmp_path / "gen.json"
    r = gen_lora(setup, adapter, "--quantize", quantize, "--metrics_file", metrics)
    want = library_text(setup, adapter, quantize)
    assert want.strip() and "\ufffd" not in want, repr(want)  # the trained adapter answers in words
    assert r.stdout == want + "\n", (r.stdout, want)
    assert f"({quantize}, {AUTO} (auto: " in r.stderr  # the script loaded what it was asked to
    assert_figures_at_end(r.stderr)
    m = json.loads(metrics.read_text())
    assert m["new_tokens"] >= 1 and math.isfinite(m["tokens_per_sec"]) and m["tokens_per_sec"] > 0
    assert m["outputs"] == [want]


def test_logits_under_quantization_are_finite(trained_adapter):
    """No NaN hides behind a plausible-looking text: the quantized models' logits for the prompt are finite."""
    setup, adapter = trained_adapter
    from lit_qlora.inference import load_for_inference
    from lit_qlora.tokenizer import Tokenizer

    ids = Tokenizer(setup["ckpt"]).encode(FORMATTED)[None]
    for q in ("bnb.nf4", "bnb.int8"):
        model, _, _ = load_for_inference(setup["ckpt"], adapter, q, "32-true", torch.device("cpu"))
        with torch.no_grad():
            assert torch.isfinite(model(ids)).all(), q


# ---- streaming ----------------------------------------------------------------------------------------------
def test_stream_printer_writes_each_character_when_it_is_complete(scripted_chat):
    """The scripted reply "Hi €" comes as six byte tokens: "H", "i", " " are written as each arrives, the first two
    bytes of "€" are held back, the third writes "€"; a reply cut inside "€" ends with what decode() gives."""
    from lit_qlora.inference import StreamPrinter
    from lit_qlora.tokenizer import Tokenizer

    tok, reply, eot = Tokenizer(scripted_chat["folder"]), scripted_chat["reply_ids"], scripted_chat["eot"]
    writes: list[str] = []
    printer = StreamPrinter(tok, skip_ids=[eot], write=writes.append)
    after_each = []
    for t in [*reply, eot]:
        printer.feed(t)
        after_each.append(len(writes))
    assert writes == ["H", "i", " ", "€"] and after_each == [1, 2, 3, 3, 3, 4, 4]
    assert printer.finish() == "Hi €" and len(writes) == 4  # nothing was held back at the end

    cut: list[str] = []
    printer = StreamPrinter(tok, write=cut.append)
    for t in reply[:5]:
        printer.feed(t)
    assert cut == ["H", "i", " "]
    assert printer.finish() == tok.decode(reply[:5]) == "Hi \ufffd" and cut == ["H", "i", " ", "\ufffd"]


@pytest.mark.parametrize("backend", ["huggingface", "sentencepiece"])
def test_stream_printer_adds_up_to_decode(backend, tmp_path):
    """Over a multilingual corpus with emoji (byte-level BPE, and sentencepiece with byte fallback): what is written
    adds up to decode(ids) exactly, and nothing written is ever taken back (each write extends a prefix of it)."""
    from helpers_tokenizer import make_hf_bpe_tokenizer, make_sentencepiece_tokenizer, tokenizer_test_corpus

    from lit_qlora.inference import StreamPrinter
    from lit_qlora.tokenizer import Tokenizer

    make = make_hf_bpe_tokenizer if backend == "huggingface" else make_sentencepiece_tokenizer
    tok = Tokenizer(make(tmp_path / backend))
    for text in tokenizer_test_corpus(120):
        ids = tok.encode(text, bos=False).tolist()
        writes: list[str] = []
        printer = StreamPrinter(tok, write=writes.append)
        for t in ids:
            printer.feed(t)
            assert tok.decode(ids).startswith("".join(writes))
        streamed = len(writes)
        assert printer.finish() == "".join(writes) == tok.decode(ids), text
        assert len(writes) == streamed  # whole characters only: everything was written while feeding


def test_run_prompts_streams_while_generating(scripted_chat, monkeypatch):
    """--stream writes each piece right after the token that completes it, before the next forward pass; without
    it the text comes at the end. The pieces are recorded with the number of forward passes run so far."""
    from lit_qlora.data.chat_template import encode_chat, stop_ids
    from lit_qlora.inference import run_prompts
    from lit_qlora.loader import load_model
    from lit_qlora.tokenizer import Tokenizer

    tok = Tokenizer(scripted_chat["folder"])
    model = load_model(scripted_chat["folder"], precision="32-true").eval()
    forwards: list[int] = []
    model.register_forward_hook(lambda *_: forwards.append(1))
    writes: list[tuple[str, int]] = []

    class Recorder:
        def write(self, piece: str) -> int:
            writes.append((piece, len(forwards)))
            return len(piece)

        def flush(self) -> None:
            pass

    monkeypatch.setattr(sys, "stdout", Recorder())
    ids = torch.tensor(encode_chat(tok, [{"role": "user", "content": "Hello"}], add_generation_prompt=True))
    stops = stop_ids(tok, tok.chat_template)
    for stream in (True, False):
        writes.clear()
        forwards.clear()
        out = run_prompts(model, tok, ids, 12, 0.0, None, None, 0, 1, stream, torch.device("cpu"), stops=stops,
                          precision="32-true")
        assert out == ["Hi €"] and "".join(w for w, _ in writes if w) == "Hi €\n"
        pieces = [(w, n) for w, n in writes if w]
        # prefill, then one pass per token up to <|eot_id|>: "€" completes at its third byte (pass 6)
        want = [("H", 1), ("i", 2), (" ", 3), ("€", 6), ("\n", 7)] if stream else [("Hi €", 7), ("\n", 7)]
        assert pieces == want, pieces


def test_samples_share_the_prompts_cache(scripted_chat, monkeypatch):
    """--num_samples: one batch of the engine. The prompt goes through the model once (the other samples start from
    its keys and values), then every step feeds one id per sample; sample i is the draw of generation.generate
    alone with the generator of seed `choice_seed(seed, i)` (the batch-1 loop, an independent reference)."""
    from lit_qlora.engine import choice_seed
    from lit_qlora.generation import generate
    from lit_qlora.inference import run_prompts
    from lit_qlora.loader import load_model
    from lit_qlora.tokenizer import Tokenizer

    tok = Tokenizer(scripted_chat["folder"])
    model = load_model(scripted_chat["folder"], precision="32-true").eval()
    fed: list[int] = []
    model.transformer.wte.register_forward_hook(lambda m, args, out: fed.append(args[0].numel()))
    ids = tok.encode("Hello there, how are")
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    shared = run_prompts(model, tok, ids, 6, 1.0, None, None, 3, 3, False, torch.device("cpu"), precision="32-true")
    prefills = [n for n in fed if n != 3]
    assert prefills == [len(ids)] and len(fed) >= 2  # one prefill, then the three samples' ids in each step
    alone = []
    for i in range(3):
        out = generate(model, ids, 6, temperature=1.0, generator=torch.Generator().manual_seed(choice_seed(3, i)))
        alone.append(tok.decode(out[len(ids):].tolist()))
    assert alone == shared
