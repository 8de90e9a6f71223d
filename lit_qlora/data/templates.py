"""Prompt templates: how an instruction record (instruction, optional input) becomes the prompt the model sees.

Besides these, the template `chat` renders conversations with the model's own chat template
(lit_qlora/data/chat_template.py); `auto` (the default) picks chat for conversation data and alpaca otherwise.
"""
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


CHAT = "chat"  # the model's own chat template
AUTO = "auto"  # chat for conversation data, alpaca for instruction records
TEMPLATE_NAMES = (*TEMPLATES, CHAT)


def check_template_name(name: str | None, allow_auto: bool = False) -> str | None:
    """`name` if it names a template (alpaca, plain, chat; auto when `allow_auto`), None for None; else a one-line
    UserError."""
    if name is None or name in TEMPLATE_NAMES or (allow_auto and name == AUTO):
        return name
    names = (*TEMPLATE_NAMES, AUTO) if allow_auto else TEMPLATE_NAMES
    raise UserError(f"unknown prompt template {name!r}; use one of: {', '.join(names)}")


def get_template(name: str | PromptTemplate) -> PromptTemplate:
    """The prompt template named `name` (alpaca or plain); chat is rendered by lit_qlora.data.chat_template instead."""
    if isinstance(name, PromptTemplate):
        return name
    if name not in TEMPLATES:
        check_template_name(name)  # an unknown name: the error lists every name
        raise UserError(f"the {name} template renders conversations, not a prompt string; this path needs one of: "
                        f"{', '.join(TEMPLATES)}")
    return TEMPLATES[name]
