"""How the suite bounds a numerical difference (tests/README.md, "How bounds are chosen"): our result is at least as
close to the exact one as the reference library's own result at the same precision, on the same inputs and CPU.

The exact result is the reference computed in float64. Each sample (a sequence, a position, an attention head: an
independent computation) gives one relative error ||got - exact|| / ||exact||. Ours passes when the mean of its
errors is at most the reference's mean plus Z standard errors of that mean (the reference's own spread over the
samples, sd / sqrt(n)). So the bound moves with the reference's error wherever it is measured: on a CPU whose 16-bit
kernels round differently (AMX against AVX512-BF16), in fp32 and in bf16 alike, and no constant that held on one
machine decides.

Z = 4: for two computations equally close to the exact result, the difference of their mean errors exceeds 4
standard errors of one mean with a probability of 1 in 430 per comparison when the two are uncorrelated (2.8
standard deviations of the difference), 1 in 2800 when they are as correlated as the least correlated pair of the
model tests (rho = 0.3), far less for the usual rho > 0.8. A real gap shows: a bf16 gradient of Gemma 3 1.7x further
from the exact one than transformers' would be 15 standard errors above it (tests/test_model.py)."""
from __future__ import annotations

import copy

import torch

Z = 4.0
MIN_SAMPLES = 8  # fewer, and the reference's spread is not known well enough to bound by
SEQUENCES = 16  # rows of the token batches the comparisons run


def relative_errors(got: torch.Tensor, exact: torch.Tensor, sample_dims: int = 1) -> torch.Tensor:
    """||got_i - exact_i|| / ||exact_i|| for each sample i, the samples indexed by the first `sample_dims` dims."""
    exact = exact.double()
    diff = (got.double() - exact).flatten(sample_dims).flatten(0, sample_dims - 1)
    return diff.norm(dim=-1) / exact.flatten(sample_dims).flatten(0, sample_dims - 1).norm(dim=-1)


def bound(reference_errors: torch.Tensor) -> float:
    """The largest mean error `assert_as_close_as` accepts, from the reference's own errors."""
    n = reference_errors.numel()
    spread = reference_errors.std().item() / n**0.5 if n > 1 else 0.0
    return reference_errors.mean().item() + Z * spread


def as_close_as(got: torch.Tensor, reference: torch.Tensor, exact: torch.Tensor, what: str = "",
                sample_dims: int = 1) -> tuple[bool, str]:
    """(whether `got` is at least as close to `exact` as `reference` is, by the rule in this module's docstring; the
    numbers)."""
    ours, theirs = relative_errors(got, exact, sample_dims), relative_errors(reference, exact, sample_dims)
    limit = bound(theirs)
    return ours.mean().item() <= limit, (
        f"{what}: mean relative error {ours.mean().item():.4g} over {ours.numel()} samples, the reference's "
        f"{theirs.mean().item():.4g} (bound {limit:.4g}, sd {theirs.std().item():.3g})")


def assert_as_close_as(got: torch.Tensor, reference: torch.Tensor, exact: torch.Tensor, what: str = "",
                       sample_dims: int = 1) -> None:
    ok, numbers = as_close_as(got, reference, exact, what, sample_dims)
    assert ok, numbers


def exact_model(hf_model: torch.nn.Module) -> torch.nn.Module:
    """A float64 copy of a transformers model: the exact result its fp32 and 16-bit runs are measured against
    (mixtures of experts through transformers' eager experts, its grouped_mm taking no float64)."""
    model = copy.deepcopy(hf_model).double()
    model.set_experts_implementation("eager")
    return model


def logits_as_close_as(got: torch.Tensor, hf_model: torch.nn.Module, idx: torch.Tensor,
                       what: str = "logits") -> tuple[bool, str]:
    """`as_close_as` for our fp32 logits `got` of tokens `idx` [B, T] against a transformers (or PEFT) model: its
    fp32 logits the reference, its float64 copy's the exact ones, each sequence a sample (positions of one sequence
    share its tokens: their errors are not independent)."""
    assert idx.size(0) >= MIN_SAMPLES, f"{idx.size(0)} sequences: too few to know the reference's spread"
    with torch.no_grad():
        reference = hf_model(idx).logits
        exact = exact_model(hf_model)(idx).logits
    return as_close_as(got, reference, exact, what)


def assert_logits_as_close_as(got: torch.Tensor, hf_model: torch.nn.Module, idx: torch.Tensor,
                              what: str = "logits") -> None:
    ok, numbers = logits_as_close_as(got, hf_model, idx, what)
    assert ok, numbers


def assert_merged_as_close_as(got: torch.Tensor, peft_model: torch.nn.Module, idx: torch.Tensor,
                              what: str = "the merged weights") -> None:
    """Logits `got` of a model whose weights have the adapter merged into them (our merge, or our export as
    transformers loads it) compute the adapted model at least as exactly as PEFT's own merge (merge_and_unload of
    `peft_model`, fp32): both against PEFT's unmerged model in float64. (Against our unmerged model's error instead,
    the merge would also be charged the rounding of its merged weights to their dtype, which an unmerged model does
    not make.)"""
    assert idx.size(0) >= MIN_SAMPLES, f"{idx.size(0)} sequences: too few to know the reference's spread"
    with torch.no_grad():
        exact = exact_model(peft_model)(idx).logits
        reference = copy.deepcopy(peft_model).merge_and_unload()(idx).logits
    assert_as_close_as(got, reference, exact, what)
