"""Decode workers for the E|P|D topology (KV cache handed over by prefill).

Not built yet: today the prefill worker's ``pd`` role prefills and decodes (E|PD).
"""
