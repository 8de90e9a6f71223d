"""What the generate scripts share (lit_qlora/inference.py): a model loaded for generation quantizes its output layer
as the adapter was trained, unless told otherwise; a tied head stays shared with the dense embedding."""
from __future__ import annotations

import bitsandbytes as bnb
import pytest
import torch
from helpers import lora_cfg

from lit_qlora.adapter import Adapter
from lit_qlora.inference import load_for_inference
from lit_qlora.loader import load_model


def head_of(model) -> torch.nn.Module:
    head = model.lm_head
    return getattr(head, "base", head)


@pytest.mark.parametrize("recorded,asked,quantized", [(False, None, False), (True, None, True), (None, None, True),
                                                      (False, True, True), (True, False, False)],
                         ids=["trained-dense", "trained-4bit", "old-file", "asked-4bit", "asked-dense"])
def test_generation_quantizes_the_head_as_the_adapter_was_trained(train_setup, tmp_path, recorded, asked, quantized):
    ckpt = train_setup["ckpt"]  # a tiny Llama with an untied head and a tokenizer
    model = load_model(ckpt, precision="32-true", lora=lora_cfg(query=True), seed=0)
    train = {"quantize": "bnb.nf4"} | ({} if recorded is None else {"quantize_lm_head": recorded})
    Adapter.of_model(model, lora_cfg(query=True), train).save(tmp_path / "a.pth")
    loaded, _, _ = load_for_inference(ckpt, tmp_path / "a.pth", "bnb.nf4", "32-true", torch.device("cpu"),
                                      quantize_lm_head=asked)
    assert isinstance(head_of(loaded), bnb.nn.Linear4bit) is quantized
    assert isinstance(loaded.transformer.h[0].attn.qkv, bnb.nn.Linear4bit)  # the blocks are quantized either way


def test_a_tied_head_stays_shared_with_the_dense_embedding(lora_tied):
    model = load_model(lora_tied.folder, precision="32-true", quantize="bnb.nf4")
    assert type(model.lm_head) is torch.nn.Linear and model.lm_head.weight is model.transformer.wte.weight
    asked = load_model(lora_tied.folder, precision="32-true", quantize="bnb.nf4", quantize_lm_head=True)
    assert isinstance(asked.lm_head, bnb.nn.Linear4bit)  # a second, 4-bit copy only when asked for
