"""Training pieces (lit_qlora/training.py): the optimizers are what their names say, metrics.csv survives resumes."""
from __future__ import annotations

import csv
import warnings

import bitsandbytes as bnb
import pytest
import torch

from lit_qlora.training import OPTIMIZERS, MetricsLog, chunked_cross_entropy, make_optimizer

# name -> (class, paged, 8-bit state): bitsandbytes keeps 8-bit state only for tensors of 4096 elements or more
EXPECTED = {"AdamW": (torch.optim.AdamW, False, False), "AdamW8bit": (bnb.optim.AdamW8bit, False, True),
            "PagedAdamW": (bnb.optim.PagedAdamW, True, False), "PagedAdamW8bit": (bnb.optim.PagedAdamW8bit, True, True),
            "PagedAdamW32bit": (bnb.optim.PagedAdamW32bit, True, False)}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_optimizers_are_what_they_say(name):
    big, small = torch.nn.Parameter(torch.randn(64, 128)), torch.nn.Parameter(torch.randn(16))
    opt = make_optimizer(name, [big, small], lr=1e-3, weight_decay=0.0, device_type="cpu")
    cls, paged, eight_bit = EXPECTED[name]
    assert type(opt) is cls
    big.grad, small.grad = torch.randn_like(big), torch.randn_like(small)
    before = big.detach().clone()
    with warnings.catch_warnings(record=True) as seen:  # the current filters: pytest's, and what make_optimizer set
        opt.step()
    assert not torch.equal(big, before)  # it updates
    assert not [str(w.message) for w in seen if "Paged" in str(w.message)]  # our note said it, once (paged on CPU)
    if cls is torch.optim.AdamW:
        assert opt.state[big]["exp_avg"].dtype == torch.float32
        return
    assert opt.is_paged is paged
    assert opt.state[big]["state1"].dtype == (torch.uint8 if eight_bit else torch.float32)
    assert opt.state[big]["state2"].dtype == (torch.uint8 if eight_bit else torch.float32)
    assert opt.state[small]["state1"].dtype == torch.float32  # below min_8bit_size


def test_metrics_csv_keeps_the_starting_validation_row_on_resume(tmp_path):
    """Iteration 0 holds only the starting validation (no training loss): a resume keeps it, and drops what came after
    the resumed iteration (those iterations run again)."""
    log = MetricsLog(tmp_path)
    log.log(dict(iter=0, step=0, val_loss=2.5, val_ppl=12.2))
    for i in range(1, 7):
        log.log(dict(iter=i, step=i, loss=3.0 - i / 10, lr=1e-3, iter_time_ms=10.0, tokens=8, tokens_per_sec=800.0))
    MetricsLog(tmp_path, resume_iter=4)
    with open(tmp_path / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["iter"]) for r in rows] == [0, 1, 2, 3, 4]
    assert rows[0]["val_loss"] == "2.5" and rows[0]["loss"] == ""
    assert float(rows[4]["loss"]) == pytest.approx(2.6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunked", [False, True])
def test_chunked_cross_entropy_equals_torch(dtype, chunked):
    """The training loss (its own autograd function) against F.cross_entropy on the fp32 upcast, reduction "sum",
    with ignored targets: the loss and the logits' gradient (in the logits' dtype), for [N, V] and chunked [B, T, V]
    logits; an ignored row gets no gradient."""
    g = torch.Generator().manual_seed(0)
    B, T, V = 3, 10, 97
    logits = (torch.randn(B, T, V, generator=g) * 4).to(dtype)
    targets = torch.randint(0, V, (B, T), generator=g)
    targets[0, :4] = -100
    targets[2, -1] = -100
    upstream = 0.37
    ref_in = logits.clone().requires_grad_()
    ref = torch.nn.functional.cross_entropy(ref_in.float().reshape(-1, V), targets.reshape(-1), ignore_index=-100,
                                            reduction="sum")
    (ref * upstream).backward()
    ours_in = logits.clone().requires_grad_()
    if chunked:
        loss = chunked_cross_entropy(list(ours_in.split(4, dim=1)), targets)
    else:
        loss = chunked_cross_entropy(ours_in.reshape(-1, V), targets.reshape(-1))
    (loss * upstream).backward()
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-5)
    assert ours_in.grad.dtype == dtype
    torch.testing.assert_close(ours_in.grad, ref_in.grad, rtol=1e-5, atol=1e-6)
    assert ours_in.grad[0, :4].abs().max() == 0 and ours_in.grad[1].abs().max() > 0
