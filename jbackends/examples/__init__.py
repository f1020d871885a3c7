"""Runnable examples. `python -m jbackends.examples.train_gpt` is the main demo."""
