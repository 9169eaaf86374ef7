"""Encoder-output (EC) store: object format, validation and the S3-backed store."""
