"""Training data: the one record reader, what a --data_dir names, prompt and chat templates (rendered as
transformers renders them, with assistant masks), tokenized caches, streaming, batches without padding."""
