"""Training pieces (train/training.py): the optimizers are what their names say, metrics.csv survives resumes."""
from __future__ import annotations

import csv
import warnings

import bitsandbytes as bnb
import pytest
import torch

from lit_qlora.train.training import OPTIMIZERS, MetricsLog, make_optimizer

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


