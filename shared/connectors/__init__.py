"""vLLM connector plugins over the project store, loaded by vLLM by module path: the EC connector
(:mod:`shared.connectors.s3_ec`) and the KV connector (:mod:`shared.connectors.s3_kv`), their
shared configuration and fingerprints (:mod:`.common`) and the typed transfer params (:mod:`.params`)."""
