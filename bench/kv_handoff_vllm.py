"""Benchmark: the E|P|D KV hand-off on the vLLM engine, side by side with the aggregated run.

Two vLLM engines on one model (a KV producer and a KV consumer, prefix caching off so every run
computes) and an embedded S3 server; for each round, in turn:

* ``aggregated``: the consumer engine on the request without a hand-off: encode + prefill + decode
  (also what a lost KV object costs the decode side);
* ``prefill``:    the producer computes the prompt and stores its KV object;
* ``decode``:     the consumer loads that object and decodes (vLLM computes the last prompt token).

``aggregated`` and ``decode`` run on the same engine: vLLM binds each engine's threads to cores
of its own choosing, so times of two engines on one small machine are not comparable.

Run: ``.venv/bin/python bench/kv_handoff_vllm.py [--model DIR] [--rounds 5] [--max-tokens 32]``
(default model: the ~130M bench Qwen2-VL, built into var/models if missing). Prints medians and the
ratios to ``aggregated``; the machine is shared, so only ratios from one run mean anything.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=448)
    args = parser.parse_args()

    from shared.engines.base import GenerationStats, SamplingParams
    from shared.engines.vllm_engine import VllmEngine
    from shared.protocol import ECSource
    from shared.store.objects import S3ObjectStore
    from shared.tools.infra import EmbeddedS3
    from shared.tools.models.tiny import build_tiny_model
    from tests.stackutil import engine_messages
    from tests.vllmutil import media

    model = args.model or ROOT / "var" / "models" / "qwen2-vl-bench"
    if not (model / "config.json").is_file():
        build_tiny_model(model, arch="qwen2_vl", size="bench", seed=0)
    (ROOT / "var").mkdir(exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kvbench-", dir=ROOT / "var"))
    s3 = EmbeddedS3(data_dir=work / "s3")
    s3.start()
    engines = []
    try:
        os.environ["EPD_BENCH_AK"], os.environ["EPD_BENCH_SK"] = s3.access_key, s3.secret_key
        S3ObjectStore(s3.endpoint, s3.access_key, s3.secret_key, "bench").ensure_bucket()
        config = {
            "endpoint": s3.endpoint,
            "bucket": "bench",
            "namespace": "bench",
            "access_key_env": "EPD_BENCH_AK",
            "secret_key_env": "EPD_BENCH_SK",
        }
        common = dict(dtype="float32", work_dir=work / "vllm", engine_args={"enable_prefix_caching": False})
        producer = VllmEngine(model, kv_role="kv_producer", ec_extra_config=config, **common)
        engines.append(producer)
        consumer = VllmEngine(model, kv_role="kv_consumer", ec_extra_config=config, **common)
        engines.append(consumer)

        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        times: dict[str, list[float]] = {k: [] for k in ("aggregated", "prefill", "decode")}
        prompt_tokens = 0
        for r in range(args.rounds + 1):  # round 0 warms up and is not counted
            items = [media(1000 + r, (args.image_size, args.image_size))]
            messages = engine_messages("Describe the image in detail.", 1)

            t = time.perf_counter()
            want = [e.token_id for e in consumer.generate(messages, items, params)]
            aggregated = time.perf_counter() - t

            stats = GenerationStats()
            t = time.perf_counter()
            kv = producer.prefill_for_handoff(
                messages, items, params, request_name=f"b{uuid.uuid4().hex[:12]}", attempt=0, stats=stats
            )
            prefill = time.perf_counter() - t

            dstats = GenerationStats()
            t = time.perf_counter()
            got = [e.token_id for e in consumer.generate(messages, items, params, dstats, kv_params=kv)]
            decode = time.perf_counter() - t
            assert dstats.extra.get("kv_source") == ECSource.STORE, dstats.extra
            assert got == want, "disaggregated output differs from the aggregated run"
            if r:
                for key, value in zip(times, (aggregated, prefill, decode)):
                    times[key].append(value)
                prompt_tokens = stats.prompt_tokens

        base = statistics.median(times["aggregated"])
        print(
            f"model {model.name}, {prompt_tokens} prompt tokens, {args.max_tokens} output tokens, "
            f"{args.rounds} rounds (medians; outputs equal in every round)"
        )
        for key, values in times.items():
            med = statistics.median(values)
            note = "  (producer engine)" if key == "prefill" else ""
            print(f"  {key:<11} {med * 1e3:8.1f} ms   x{med / base:.2f} of aggregated{note}")
        kv_objects = S3ObjectStore(s3.endpoint, s3.access_key, s3.secret_key, "bench").list("bench/kv/")
        sizes = [info.size for info in kv_objects]
        if sizes:
            print(f"  KV object  {statistics.median(sizes) / 1e6:.2f} MB (median of {len(sizes)})")
    finally:
        for engine in reversed(engines):
            engine.close()
        s3.stop()


if __name__ == "__main__":
    main()
