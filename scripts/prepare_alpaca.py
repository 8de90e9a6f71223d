"""Prepare an Alpaca-format dataset (a JSON list of {"instruction", "input", "output"}) for fine-tuning.

    python scripts/prepare_alpaca.py --data_file alpaca_data.json --checkpoint_dir checkpoints/X
"""
from pathlib import Path

from lit_qlora.data.prepare import DataSettings, prepare_dataset
from lit_qlora.utils import run_cli


def prepare(
    data_file: Path,
    checkpoint_dir: Path,
    destination_path: Path = Path("data/alpaca"),
    max_seq_length: int | None = None,
    mask_inputs: bool = True,
    test_split_fraction: float = 0.05,
    seed: int = 42,
    template: str = "alpaca",
) -> None:
    """Tokenize an Alpaca-format dataset into train.pt / val.pt / prepare_config.json.

    Args:
        data_file: Alpaca-format .json or .jsonl (e.g. alpaca_data.json, or lit_qlora/demo/demo_data.json).
        checkpoint_dir: Model folder whose tokenizer is used.
        destination_path: Folder to write the prepared data into (pass it to finetuning as --data_dir).
        max_seq_length: Longer samples are truncated. Default: the model's context length.
        mask_inputs: Train only on the response tokens (the prompt gets no loss).
        test_split_fraction: Share of records held out for validation.
        seed: Seed of the train/validation split.
        template: Prompt template: alpaca, plain, or chat (the model's own chat template, one user turn per record).
    """
    settings = DataSettings(max_seq_length or 0, template=template, mask_inputs=mask_inputs,
                            test_split_fraction=test_split_fraction, seed=seed)
    prepare_dataset(data_file, checkpoint_dir, destination_path, settings)


if __name__ == "__main__":
    run_cli(prepare)
