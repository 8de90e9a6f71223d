"""Adapters leaving the project: PEFT folders both ways, merging into full-precision weights, GGUF files
for llama.cpp / Ollama."""
