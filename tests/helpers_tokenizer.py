"""Tiny tokenizers built locally (no downloads) for the tests.

`make_hf_bpe_tokenizer` writes a byte-level BPE `tokenizer.json` (Llama-3 / GPT-2 style) and
`make_sentencepiece_tokenizer` a byte-fallback BPE `tokenizer.model` (Llama-2 style), each with a
`tokenizer_config.json`. Both train on `TRAINING_TEXT` in well under a second and are deterministic,
so their files (and the `Tokenizer.fingerprint` of a folder) are the same on every run.
`tokenizer_test_corpus()` is a fixed set of >= 200 strings for comparing tokenizers.
"""
from __future__ import annotations

import io
import json
import random
from pathlib import Path

SPECIAL_TOKENS = {"unk": "<unk>", "bos": "<s>", "eos": "</s>", "pad": "<pad>"}

# Small multilingual training text. Each line is repeated so that common words become pieces.
TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Instruction: write a short story about a robot who learns to paint.",
    "Response: Once upon a time, there was a little robot named Pixel.",
    "Below is an instruction that describes a task. Write a response that completes the request.",
    "Der schnelle braune Fuchs springt über den faulen Hund. Grüße aus München!",
    "Le renard brun rapide saute par-dessus le chien paresseux. À bientôt, ça va ?",
    "El rápido zorro marrón salta sobre el perro perezoso. ¿Dónde está la biblioteca?",
    "Быстрая коричневая лиса прыгает через ленивую собаку. Привет, как дела?",
    "敏捷的棕色狐狸跳过了懒狗。你好，世界！今天天气很好。",
    "素早い茶色の狐がのろまな犬を飛び越える。こんにちは、世界。",
    "빠른 갈색 여우가 게으른 개를 뛰어넘습니다. 안녕하세요!",
    "الثعلب البني السريع يقفز فوق الكلب الكسول. مرحبا بالعالم",
    "Η γρήγορη καφέ αλεπού πηδά πάνω από τον τεμπέλη σκύλο.",
    "def add(a: int, b: int) -> int:\n    return a + b\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += x[i];\n}",
    'print("hello, world")  # comment\nx = [1, 2, 3]\n',
    "<div class=\"note\">Total: 1,234.56 EUR (2024-01-31)</div>",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2048 3.14159 -7 1e-5",
    "Emoji are fun 😀🎉👍 and so are symbols ∑ ∞ ≈ → ©.",
    "    indented line\n\n\ttabbed line\r\nwindows line end",
]
TRAINING_REPEATS = 20


def _training_lines() -> list[str]:
    return TRAINING_TEXT * TRAINING_REPEATS


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def make_hf_bpe_tokenizer(
    folder: Path,
    vocab_size: int = 512,
    bos_in_post_processor: bool = True,
    add_bos_token: bool | None = True,
    chat_template: str | None = None,
    split_regex: str | None = None,
) -> Path:
    """Write a byte-level BPE tokenizer.json + tokenizer_config.json into `folder`.

    Ids 0..3 are <unk>, <s>, </s>, <pad>. With `bos_in_post_processor` the tokenizer.json's
    post-processor prepends <s> (like Llama 3's); `add_bos_token=None` leaves the key out of
    tokenizer_config.json. Text is split with GPT-2's regex (inside ByteLevel), or with `split_regex`
    before a regex-free ByteLevel, as Llama 3's and Qwen2's tokenizer.json do.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    if split_regex is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split_regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte is a token: nothing is unknown
        show_progress=False,
    )
    tok.train_from_iterator(_training_lines(), trainer=trainer)
    bos = SPECIAL_TOKENS["bos"]
    if bos_in_post_processor:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, tok.token_to_id(bos))]
        )
    tok.save(str(folder / "tokenizer.json"))

    config: dict = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": SPECIAL_TOKENS["eos"],
        "unk_token": SPECIAL_TOKENS["unk"],
        "pad_token": SPECIAL_TOKENS["pad"],
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
    }
    if add_bos_token is not None:
        config["add_bos_token"] = add_bos_token
    if chat_template is not None:
        config["chat_template"] = chat_template
    _write_json(folder / "tokenizer_config.json", config)
    return folder


def make_sentencepiece_tokenizer(
    folder: Path, vocab_size: int = 512, add_bos_token: bool | None = True, chat_template: str | None = None
) -> Path:
    """Write a Llama-2 style sentencepiece tokenizer.model + tokenizer_config.json into `folder`.

    BPE with byte fallback (so emoji and unseen characters round-trip), identity normalization and
    no whitespace collapsing, like Llama's model. Ids 0..3 are <unk>, <s>, </s>, <pad>; 4..259 are
    the byte pieces <0x00>..<0xFF>. sentencepiece needs a piece for each character it keeps (it keeps
    >= 98% of the corpus' characters), so vocab_size must be at least ~470 for this corpus.
    """
    import sentencepiece as spm

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    # Train from an iterator into memory: a file-based run records the input and output paths in the
    # model's trainer_spec, which would make the bytes (and so the fingerprint) differ per folder.
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_training_lines()),
        model_writer=model,
        model_type="bpe",
        vocab_size=vocab_size,
        character_coverage=0.99,  # leave rare characters to byte fallback so that path is exercised
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=True,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=3,
        unk_piece=SPECIAL_TOKENS["unk"],
        bos_piece=SPECIAL_TOKENS["bos"],
        eos_piece=SPECIAL_TOKENS["eos"],
        pad_piece=SPECIAL_TOKENS["pad"],
        num_threads=1,  # deterministic and polite on small machines
        minloglevel=2,  # quiet
    )
    (folder / "tokenizer.model").write_bytes(model.getvalue())

    config: dict = {
        # transformers 5 loads tokenizer.model through LlamaTokenizer, converting it to a `tokenizers` BPE
        "tokenizer_class": "LlamaTokenizer",
        # the dict form that Llama 2's tokenizer_config.json uses
        "bos_token": {
            "__type": "AddedToken",
            "content": SPECIAL_TOKENS["bos"],
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
        },
        "eos_token": SPECIAL_TOKENS["eos"],
        "unk_token": SPECIAL_TOKENS["unk"],
        "pad_token": SPECIAL_TOKENS["pad"],
        "add_eos_token": False,
        "legacy": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
    }
    if add_bos_token is not None:
        config["add_bos_token"] = add_bos_token
    if chat_template is not None:
        config["chat_template"] = chat_template
    _write_json(folder / "tokenizer_config.json", config)
    return folder


# Pieces for the test corpus: words in several scripts, emoji, numbers, code and whitespace.
_WORDS = [
    "hello", "world", "Hello", "robot", "instruction", "response", "fox", "dog", "lazy", "paint",
    "Grüße", "München", "über", "ça", "bientôt", "¿Dónde", "está", "niño", "straße",
    "Привет", "мир", "собака", "лиса", "Ёжик", "быстрая",
    "你好", "世界", "狐狸", "天气", "龍", "こんにちは", "カタカナ", "안녕하세요", "여우",
    "مرحبا", "العالم", "الكلب", "שלום", "नमस्ते", "γρήγορη", "Ωμέγα", "ไทย",
    "😀", "🎉", "👍🏽", "👨‍👩‍👧", "🇩🇪", "∑", "∞", "→", "©", "\u00a0", "\u200b", "é", "e\u0301",
]
_NUMBERS = ["0", "7", "42", "100", "2048", "3.14159", "-12", "1e-5", "1,234.56", "2024-01-31", "0x1F", "99%"]
_CODE = [
    "def f(x):\n    return x * 2\n",
    "if (a && b) { return; }",
    "\tfor i in range(10):\n\t\tprint(i)",
    "SELECT * FROM users WHERE id = 1;",
    '{"key": [1, 2, {"nested": null}]}',
    "<div class=\"x\">&amp;</div>",
    "x+=1;y-=2;z**=3",
    "#include <stdio.h>\nint main() { return 0; }",
    "λx. x → x",
]
_SEPARATORS = [" ", " ", " ", "  ", "   ", "\t", "\n", "\n\n", " \n ", "", ", ", ". ", "\r\n"]


def tokenizer_test_corpus(n: int = 240, seed: int = 1234) -> list[str]:
    """A fixed list of `n` (>= 200) strings: hand-picked edge cases, then random mixtures of pieces."""
    fixed = [
        "", " ", "  ", "\n", "\t", " \t\n ", "a", " a", "a ", "  leading spaces", "trailing spaces   ",
        "multiple   inner    spaces", "tabs\tbetween\twords", "new\nlines\n\nand\n\n\nmore", "\r\n\r\n",
        "ALL CAPS", "MiXeD cAsE", "1234567890", "3.14 2.71 1.41", "😀", "😀😀😀", "👨‍👩‍👧 family",
        "你好世界", "Привет, мир!", "مرحبا بالعالم", "mixed 中文 and English and русский",
        "The quick brown fox jumps over the lazy dog.", *_CODE,
    ]
    rng = random.Random(seed)
    pool = _WORDS * 3 + _NUMBERS + _CODE
    out = list(fixed)
    while len(out) < n:
        parts = [rng.choice(pool) for _ in range(rng.randint(1, 12))]
        text = parts[0]
        for part in parts[1:]:
            text += rng.choice(_SEPARATORS) + part
        if rng.random() < 0.15:
            text = rng.choice(_SEPARATORS) + text  # leading whitespace is an edge case for dummy prefixes
        if rng.random() < 0.15:
            text += rng.choice(_SEPARATORS)
        out.append(text)
    return out
