"""Local data: a real-text corpus every machine has, a tokenizer trained on it, packed datasets."""
