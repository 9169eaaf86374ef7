"""``epd bench`` and ``epd plan``: load any OpenAI-compatible endpoint with a multimodal workload,
report it in ``vllm bench serve``'s terms (plus per-stage timings against our API), compare runs, and
size E:P:D from measured stage costs. Dev/ops tooling: nothing at runtime imports it."""
