"""Batched generation: many sequences at once over one model (continuous batching, paged keys and values, rows of
different adapters in one forward). Below the server, batch inference, evaluation and on-policy training."""
from lit_qlora.engine.engine import Completion, Engine, Sampling, Sequence, choice_seed, generate_batch

__all__ = ["Completion", "Engine", "Sampling", "Sequence", "choice_seed", "generate_batch"]
