"""Fixtures shared by several test files. Every name is unique in the suite; each builds its models locally, once.

- family_ckpt: a tiny random HF model of each supported family (parametrized), converted, with transformers' model and
  ours loaded (test_model, test_convert)
- lora_llama / lora_neox / lora_tied / lora_falcon7b / lora_falcon40b / lora_phi3: converted tiny checkpoints for
  LoRA, PEFT and merge tests; lora_ckpt runs a test on each of the first three
- train_setup: a tiny Llama with a byte-level BPE tokenizer and a learnable data set, for the scripts' tests
- trained_run: (out_dir, result) of one finetune/lora.py run on train_setup that learns the task
- scripted_chat: a tiny Llama 3-style chat checkpoint whose model answers a known reply (helpers_chat)
"""
from __future__ import annotations

from types import SimpleNamespace

import helpers_train
import pytest
from helpers import TINY_HF_CONFIGS, converted_tiny, load_ours, make_tiny_hf_model
from helpers_chat import make_scripted_chat_model

from lit_qlora.convert import convert_hf_checkpoint


@pytest.fixture(scope="session", params=list(TINY_HF_CONFIGS))
def family_ckpt(request, tmp_path_factory):
    """A random tiny HF model of one family, saved and converted to ours (built once per family)."""
    folder = tmp_path_factory.mktemp(request.param)
    # weights 10x the default init: with tiny random weights greedy decoding just repeats one token
    hf = make_tiny_hf_model(request.param, folder, initializer_range=0.2)
    convert_hf_checkpoint(folder)
    return SimpleNamespace(kind=request.param, folder=folder, hf=hf, ours=load_ours(folder))


@pytest.fixture(scope="session")
def lora_llama(tmp_path_factory):
    return converted_tiny(tmp_path_factory, "llama", "tiny-llama")


@pytest.fixture(scope="session")
def lora_neox(tmp_path_factory):  # one fused query_key_value Linear in transformers
    return converted_tiny(tmp_path_factory, "gpt_neox", "tiny-neox")


@pytest.fixture(scope="session")
def lora_tied(tmp_path_factory):  # tied embeddings + GQA with one kv head: the head LoRA must untie on merge
    return converted_tiny(tmp_path_factory, "llama3", "tiny-llama3")


@pytest.fixture(scope="session")
def lora_falcon7b(tmp_path_factory):  # one fused multi-query query_key_value, tied head
    return converted_tiny(tmp_path_factory, "falcon7b", "tiny-falcon7b")


@pytest.fixture(scope="session")
def lora_falcon40b(tmp_path_factory):  # one fused query_key_value grouped per kv head, tied head
    return converted_tiny(tmp_path_factory, "falcon40b", "tiny-falcon40b")


@pytest.fixture(scope="session")
def lora_phi3(tmp_path_factory):  # one fused qkv_proj and one fused gate_up_proj in transformers
    return converted_tiny(tmp_path_factory, "phi3", "tiny-phi3")


@pytest.fixture(params=["lora_llama", "lora_neox", "lora_tied"])
def lora_ckpt(request):
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="session")
def train_setup(tmp_path_factory):
    return helpers_train.tiny_setup(tmp_path_factory)


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory):
    return helpers_train.trained_run(tmp_path_factory)


@pytest.fixture(scope="session")
def scripted_chat(tmp_path_factory):
    return make_scripted_chat_model(tmp_path_factory.mktemp("scripted_chat") / "chat-model")
