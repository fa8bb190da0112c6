"""Data: the GPT-2 tokenizer, the grain pipeline over prepared token shards, and synthetic recall tasks.
`Batch` (batch.py) is the typed batch they yield and the train step takes. They import nothing else from
the library but the array alias."""
