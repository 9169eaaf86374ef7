"""The EC store lifecycle, in one package (see docs/operations.md, "The EC store").

* :mod:`.index` - the index of EC objects in a JetStream key-value bucket (entries, the
  fingerprint registry, the janitor lease; ``ECIndex.generation``).
* :mod:`.janitor` - the janitor that keeps the EC namespace bounded, listings of the store, the
  S3 lifecycle backstop, and purges (``epd ec purge``).
* :mod:`.invalidation` - ``ECInvalidated`` published and subscribed to (asyncio), and the thread
  the vLLM EC connector runs it in (its process never waits on NATS).
* :mod:`.worker` - a generating worker's part (use records, dropping invalidated cached items).

torch-free: the API and the CLI run it. NATS settings come from the caller (settings, or the
connector's extra config), never from the environment.
"""
