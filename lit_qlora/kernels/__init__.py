"""CPU kernels the model calls: attention without a materialized mask, and half-precision matmuls that
keep fp32 accumulation."""
