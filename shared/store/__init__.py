"""The object store: one S3/fs object layer (objects.py), the tensor-object format (format.py), one tensor-object
store (tensor_store.py) with its EC (ec.py: encoder outputs) and KV (kv.py: decode state) codecs and typed fronts."""
