"""Prompt templates: how an instruction record (instruction, optional input) becomes the prompt the model sees."""
from __future__ import annotations

from dataclasses import dataclass

from lit_qlora.utils import UserError


@dataclass(frozen=True)
class PromptTemplate:
    name: str
    with_input: str  # uses {instruction} and {input}
    without_input: str  # uses {instruction}; chosen when the input is empty

    def format(self, instruction: str, input: str = "") -> str:
        if input.strip():
            return self.with_input.format(instruction=instruction, input=input)
        return self.without_input.format(instruction=instruction)


TEMPLATES: dict[str, PromptTemplate] = {
    t.name: t
    for t in (
        PromptTemplate(
            name="alpaca",
            with_input=(
                "Below is an instruction that describes a task, paired with an input that provides "
                "further context. Write a response that appropriately completes the request.\n\n"
                "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
            ),
            without_input=(
                "Below is an instruction that describes a task. "
                "Write a response that appropriately completes the request.\n\n"
                "### Instruction:\n{instruction}\n\n### Response:\n"
            ),
        ),
        PromptTemplate(name="plain", with_input="{instruction}\n{input}\n", without_input="{instruction}\n"),
    )
}


def get_template(name: str | PromptTemplate) -> PromptTemplate:
    if isinstance(name, PromptTemplate):
        return name
    if name not in TEMPLATES:
        raise UserError(f"unknown prompt template {name!r}; use one of: {', '.join(TEMPLATES)}")
    return TEMPLATES[name]
