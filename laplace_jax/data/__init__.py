"""Data: the GPT-2 tokenizer, the grain pipeline over prepared token shards, and synthetic recall tasks.
They import nothing else from the library."""
