"""lazytrain: train and serve large language models on one memory-limited GPU."""

__version__ = "0.1.0"
