"""Sampling one token per row from the step's logits: settings, penalties, bans and logprobs."""
