"""vLLM connector plugins over the project store: the S3 EC connector and the S3 KV connector (loaded by vLLM by module path)."""
