"""Prepare any JSON / JSONL / CSV instruction dataset, or a JSON / JSONL file of conversations, for fine-tuning.

    python scripts/prepare_json.py --data_file my.csv --checkpoint_dir checkpoints/X \
        --instruction_key question --output_key answer --destination_path data/my
    python scripts/prepare_json.py --data_file chats.jsonl --checkpoint_dir checkpoints/X-Instruct \
        --destination_path data/chats      # {"messages": [{"role": ..., "content": ...}, ...]} per line
"""
from pathlib import Path

from lit_qlora.data.prepare import DataSettings, prepare_dataset
from lit_qlora.utils import run_cli


def prepare(
    data_file: Path,
    checkpoint_dir: Path,
    destination_path: Path = Path("data/json"),
    max_seq_length: int | None = None,
    mask_inputs: bool = True,
    test_split_fraction: float = 0.05,
    seed: int = 42,
    template: str = "auto",
    instruction_key: str = "instruction",
    input_key: str = "input",
    output_key: str = "output",
) -> None:
    """Tokenize a dataset into train.pt / val.pt / prepare_config.json.

    Args:
        data_file: .json (list of objects), .jsonl (one object per line) or .csv (with a header row). Objects are
            instruction records, or conversations: "messages" (role/content: system, user, assistant) or ShareGPT
            "conversations" (from/value: system, human, gpt).
        checkpoint_dir: Model folder whose tokenizer is used.
        destination_path: Folder to write the prepared data into (pass it to finetuning as --data_dir).
        max_seq_length: Longer samples are truncated. Default: the model's context length.
        mask_inputs: Train only on the response tokens (the prompt gets no loss; with chat, the assistant turns).
        test_split_fraction: Share of records held out for validation.
        seed: Seed of the train/validation split.
        template: alpaca, plain, chat (the model's own chat template) or auto: chat for conversations, else alpaca.
        instruction_key: Field holding the instruction.
        input_key: Field holding the optional input (missing or empty is fine).
        output_key: Field holding the expected response.
    """
    settings = DataSettings(max_seq_length or 0, template=template, mask_inputs=mask_inputs,
                            test_split_fraction=test_split_fraction, seed=seed, instruction_key=instruction_key,
                            input_key=input_key, output_key=output_key)
    prepare_dataset(data_file, checkpoint_dir, destination_path, settings)


if __name__ == "__main__":
    run_cli(prepare)
