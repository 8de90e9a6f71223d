"""lit-qlora: LoRA / QLoRA fine-tuning, generation, merging and export for open LLMs.

Public API: `Config`, `GPT`, `Tokenizer`, `LoRAConfig` and `load_model`, the one loader that builds a model
(optionally quantized, optionally with LoRA layers) from a checkpoint folder.
"""
from lit_qlora.config import Config
from lit_qlora.loader import load_model
from lit_qlora.lora import LoRAConfig
from lit_qlora.model import GPT
from lit_qlora.tokenizer import Tokenizer

__all__ = ["Config", "GPT", "LoRAConfig", "Tokenizer", "load_model"]
__version__ = "0.1.0"
