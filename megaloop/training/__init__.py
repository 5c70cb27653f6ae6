"""Training a Llama-family checkpoint in the loop kernel: the step as one graph (graph.py), the
token data (data.py), ``Trainer`` (trainer.py) and the checkpoints it writes (checkpoint.py); the
``megaloop train`` command wraps it (commands.py). docs/training.md."""
