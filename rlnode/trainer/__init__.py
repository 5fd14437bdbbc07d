"""Trainer role: where samples are consumed (buffer, loss, optimizer, weight
broadcast, checkpoints)."""
