"""Operator and development tools (the `epd` CLI, launcher, embedded NATS/S3 servers, tiny models, replay).

Nothing under shared/ outside this package, and nothing under services/, imports it: production images run
the services and the runtime library only.
"""
