"""Small checkpoints' tokenizers for chat-template tests, built locally (no downloads) with the special tokens of real
chat models: byte-level BPE (Llama 3 / Qwen style), Metaspace BPE (Gemma / Mistral tokenizer.json style) and
sentencepiece tokenizer.model (Llama 2 / Mistral v0.1 / Zephyr style). Templates come from tests/fixtures.
"""
from __future__ import annotations

import io
import json
from pathlib import Path

from helpers_tokenizer import TRAINING_TEXT, make_sentencepiece_tokenizer

TEMPLATES_DIR = Path(__file__).parent / "fixtures" / "chat_templates"

# Text the tokenizers learn from, with chat words so that turns are not all single characters.
CHAT_TEXT = [
    "Hello, how are you? I'm fine, thanks! What is 2 + 2? Sure: 2 + 2 = 4.",
    "You are a helpful assistant. Answer briefly and politely.",
    "Tell me a joke about robots. Why did the robot cross the road?",
    "system user assistant model tool function arguments weather Paris",
]


def load_template(name: str) -> str:
    """A fixture template, byte for byte."""
    return (TEMPLATES_DIR / f"{name}.jinja").read_bytes().decode("utf-8")


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def make_bpe_chat_tokenizer(
    folder: Path,
    specials: list[str],
    *,
    bos: str | None,
    eos: str,
    unk: str | None = None,
    pad: str | None = None,
    plain_added: tuple[str, ...] = (),
    metaspace: bool = False,
    bos_in_post_processor: bool = False,
    chat_template: str | None = None,
) -> Path:
    """Write tokenizer.json + tokenizer_config.json (PreTrainedTokenizerFast) into `folder`.

    specials become special added tokens (ids 0..), plain_added non-special added tokens (like Qwen's <tool_call>).
    metaspace: a "▁"-based BPE (prepend_scheme first) instead of byte-level.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if metaspace:
        tok = Tokenizer(models.BPE(unk_token=unk))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first", split=False)
        alphabet: list[str] = []
    else:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=specials, initial_alphabet=alphabet,
                                  show_progress=False)
    tok.train_from_iterator((TRAINING_TEXT + CHAT_TEXT) * 20, trainer=trainer)
    if plain_added:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain_added])
    if bos_in_post_processor and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, tok.token_to_id(bos))])
    elif not metaspace:
        tok.post_processor = processors.ByteLevel(trim_offsets=True)  # GPT-2 style: trims offsets off spaces
    tok.save(str(folder / "tokenizer.json"))
    config: dict = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
                    "clean_up_tokenization_spaces": False, "model_max_length": 4096}
    if unk is not None:
        config["unk_token"] = unk
    if pad is not None:
        config["pad_token"] = pad
    if chat_template is not None:
        config["chat_template"] = chat_template
    _write_json(folder / "tokenizer_config.json", config)
    return folder


def make_sp_chat_tokenizer(folder: Path, chat_template: str, legacy: bool = False) -> Path:
    """A Llama-2 style tokenizer.model (<unk> <s> </s> <pad>) with `chat_template` in tokenizer_config.json."""
    folder = make_sentencepiece_tokenizer(folder, chat_template=chat_template)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["legacy"] = legacy
    _write_json(config_path, config)
    return folder


def make_sp_without_byte_fallback(folder: Path) -> Path:
    """A sentencepiece tokenizer.model without byte fallback: rare characters become <unk>."""
    import sentencepiece as spm

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TRAINING_TEXT * 20), model_writer=model, model_type="bpe", vocab_size=400,
        character_coverage=0.98, byte_fallback=False, normalization_rule_name="identity",
        remove_extra_whitespaces=False, unk_id=0, bos_id=1, eos_id=2, pad_id=3, num_threads=1, minloglevel=2)
    (folder / "tokenizer.model").write_bytes(model.getvalue())
    _write_json(folder / "tokenizer_config.json", {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>",
                                                   "eos_token": "</s>", "unk_token": "<unk>", "legacy": False})
    return folder


LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                   "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"]
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
PHI4_SPECIALS = [*CHATML_SPECIALS, "<|im_sep|>"]
GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
# gpt-oss's o200k_harmony special tokens (ids 199998-200012 there): bos <|startoftext|>, eos <|return|>, pad
# <|endoftext|>; generation_config.json's eos ids are <|return|>, <|endoftext|>, <|call|>
HARMONY_SPECIALS = ["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>",
                    "<|end|>", "<|message|>", "<|call|>"]
MISTRAL3_SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                     "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]


def make_chat_checkpoint(kind: str, folder: Path, template: str) -> Path:
    """A tokenizer folder for a model family: llama3, chatml_qwen, chatml_smollm, chatml_phi4, gemma, mistral3,
    harmony, sp, sp_legacy."""
    if kind == "llama3":
        return make_bpe_chat_tokenizer(folder, LLAMA3_SPECIALS, bos="<|begin_of_text|>", eos="<|eot_id|>",
                                       bos_in_post_processor=True, chat_template=template)
    if kind == "chatml_qwen":  # Qwen2.5: no bos token at all, <tool_call> is an added but not special token
        return make_bpe_chat_tokenizer(folder, CHATML_SPECIALS, bos=None, eos="<|im_end|>", pad="<|endoftext|>",
                                       plain_added=("<tool_call>", "</tool_call>"), chat_template=template)
    if kind == "chatml_smollm":
        return make_bpe_chat_tokenizer(folder, CHATML_SPECIALS, bos="<|im_start|>", eos="<|im_end|>",
                                       unk="<|endoftext|>", pad="<|im_end|>", chat_template=template)
    if kind == "chatml_phi4":  # microsoft/phi-4: bos <|endoftext|>, eos <|im_end|>, <|im_sep|> after the role
        return make_bpe_chat_tokenizer(folder, PHI4_SPECIALS, bos="<|endoftext|>", eos="<|im_end|>",
                                       pad="<|endoftext|>", chat_template=template)
    if kind == "gemma":
        return make_bpe_chat_tokenizer(folder, GEMMA_SPECIALS, bos="<bos>", eos="<eos>", unk="<unk>", pad="<pad>",
                                       metaspace=True, bos_in_post_processor=True, chat_template=template)
    if kind == "mistral3":
        return make_bpe_chat_tokenizer(folder, MISTRAL3_SPECIALS, bos="<s>", eos="</s>", unk="<unk>",
                                       metaspace=True, bos_in_post_processor=True, chat_template=template)
    if kind == "harmony":  # gpt-oss: byte-level BPE, no bos added by the tokenizer (the template writes none)
        folder = make_bpe_chat_tokenizer(folder, HARMONY_SPECIALS, bos="<|startoftext|>", eos="<|return|>",
                                         pad="<|endoftext|>", chat_template=template)
        ids = [HARMONY_SPECIALS.index(t) for t in ("<|return|>", "<|endoftext|>", "<|call|>")]
        _write_json(folder / "generation_config.json", {"bos_token_id": 0, "eos_token_id": ids, "pad_token_id": 1})
        return folder
    if kind in ("sp", "sp_legacy"):
        return make_sp_chat_tokenizer(folder, template, legacy=kind == "sp_legacy")
    raise ValueError(kind)


# ----------------------------------------------------------------------------------------------
# A scripted chat model: tiny, but it answers a known reply, so the chat scripts' outputs can be checked exactly.

SCRIPTED_REPLY = "Hi €"  # "€" is three byte tokens: streaming must hold its first two back
SCRIPTED_FALLBACK = "?"  # what it says after any other prompt (e.g. one rendered with the alpaca template)


def make_scripted_chat_model(folder: Path) -> dict:
    """A converted tiny Llama with a Llama 3 chat tokenizer that answers SCRIPTED_REPLY to any conversation.

    The checkpoint is like a base model made instruct: tokenizer_config.json names eos <|end_of_text|>,
    generation_config.json lists <|end_of_text|> and <|eom_id|>, and the chat template (in chat_template.jinja, as
    transformers >= 4.43 saves it) ends assistant turns with <|eot_id|>, which only the template names.

    The model is a bigram machine: attention and MLP outputs are zero, so the logits depend on the last token alone.
    A newline token, "\\n\\n" (the end of the template's generation prompt) or "\\n" (the end of a training sample's
    prompt, where the template's "\\n\\n" runs into the reply, and of the alpaca template's prompt), leads to "H",
    "i", " ", the three bytes of "€", then <|eot_id|>; a model that does not stop there goes on with "X" forever.
    Every other token leads to SCRIPTED_FALLBACK. Returns {folder, template, reply_ids, eot}.
    """
    import torch
    from helpers import make_tiny_hf_model

    from lit_qlora.convert import ensure_converted
    from lit_qlora.tokenizer import Tokenizer

    folder = Path(folder)
    make_bpe_chat_tokenizer(folder, LLAMA3_SPECIALS, bos="<|begin_of_text|>", eos="<|end_of_text|>",
                            bos_in_post_processor=True)
    template = load_template("llama3_instruct")
    (folder / "chat_template.jinja").write_text(template, encoding="utf-8")
    tok = Tokenizer(folder)
    ids = {t: tok.token_to_id(t) for t in LLAMA3_SPECIALS}
    starts = [tok.token_to_id("ĊĊ"), tok.token_to_id("Ċ")]  # byte-level "\n\n" and "\n"
    reply = [tok.token_to_id(t) for t in ("H", "i", "Ġ", "â", "Ĥ", "¬")]  # "Hi €" as single-byte tokens
    eot, loop, fallback = ids["<|eot_id|>"], tok.token_to_id("X"), tok.token_to_id(SCRIPTED_FALLBACK)
    chain = [*reply, eot, loop]
    steps = [(starts[0], reply[0]), (starts[1], reply[0]), *zip(chain, [*chain[1:], loop])]
    tokens = [*starts, *chain, fallback]
    assert None not in tokens and len(set(tokens)) == len(tokens)

    hf = make_tiny_hf_model("llama", folder, vocab_size=tok.vocab_size, bos_token_id=ids["<|begin_of_text|>"],
                            eos_token_id=ids["<|end_of_text|>"], max_position_embeddings=128)
    n_embd = hf.config.hidden_size
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()  # the blocks add nothing: the last token's embedding reaches the head as it is
            elif "norm" in name:
                p.fill_(1.0)
        emb, head = hf.model.embed_tokens.weight, hf.lm_head.weight
        emb.zero_()
        emb[:, 0] = 1.0  # every token not in the chain: direction 0, which leads to the fallback
        head.zero_()
        head[fallback, 0] = 10.0
        for d, (token, nxt) in enumerate(steps, start=1):
            emb[token] = 0.0
            emb[token, d] = 1.0
            head[nxt, d] = 10.0  # normed embedding (8 x a unit vector) -> logit 80 for the next token, 0 elsewhere
        assert len(steps) < n_embd
    hf.save_pretrained(folder)
    # after save_pretrained, which writes a generation_config.json of its own
    _write_json(folder / "generation_config.json", {"bos_token_id": ids["<|begin_of_text|>"],
                                                    "eos_token_id": [ids["<|end_of_text|>"], ids["<|eom_id|>"]]})
    ensure_converted(folder, quiet=True)
    return {"folder": folder, "template": template, "reply_ids": reply, "eot": eot}
