"""The --quantize modes (`QuantMode`) and what stores them: bitsandbytes layers and embeddings, stored
quantizations, MXFP4 expert bytes, and the 4-bit decode kernel."""
