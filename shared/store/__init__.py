"""The object store: one S3/fs object layer, the tensor-object format, the EC (encoder output) and KV (decode state) stores."""
