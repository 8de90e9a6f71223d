"""Prompt templates."""
from __future__ import annotations

import pytest
from helpers_data import assert_one_line_message

from lit_qlora.data.templates import get_template
from lit_qlora.utils import UserError


def test_templates():
    alpaca = get_template("alpaca")
    with_input = alpaca.format("Reverse the word.", "cat")
    assert "### Instruction:\nReverse the word.\n\n### Input:\ncat\n\n### Response:\n" in with_input
    without = alpaca.format("Say hi.")
    assert "### Input" not in without and without.endswith("### Instruction:\nSay hi.\n\n### Response:\n")
    assert alpaca.format("Say hi.", "  ") == without  # whitespace-only input counts as no input
    assert get_template("plain").format("Do it.", "x") == "Do it.\nx\n"
    with pytest.raises(UserError) as e:
        get_template("vicuna")
    assert_one_line_message(e, "alpaca", "plain")
