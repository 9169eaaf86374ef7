"""Decode workers for the E|P|D topology: continue requests from KV objects written by prefill
workers (role ``prefill``), many requests batched into one LM forward per step."""
