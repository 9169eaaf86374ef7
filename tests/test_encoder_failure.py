"""An encoder worker killed mid-job: the job is redelivered to another worker and the request completes."""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor

import pytest

from shared.media import content_hash_of
from shared.protocol import ECReady
from tests.fault_workers import ENCODE_DELAY_ENV
from tests.fault_workers import MODULE as FAULT_WORKERS
from tests.stackutil import api_tokens, final_result, noise_image, start_stack, wait_for
from tests.test_e2e_epd import reference_tokens

pytestmark = pytest.mark.slow

TEXT = "Describe the image."


def test_killed_encoder_job_is_redelivered(nats_server, s3_server, tiny_model_dir, reference_engine, tmp_path):
    # Ack wait 3 s: the killed worker's job comes back quickly. A worker starved of CPU for 3 s
    # on a loaded machine (it sends in_progress every second) may see its job redelivered once
    # more; the generous max_deliver keeps such extra deliveries from exhausting the job.
    running = start_stack(
        nats_server,
        s3_server,
        tiny_model_dir,
        tmp_path / "logs",
        service_env={"encoder": {ENCODE_DELAY_ENV: "600"}},
        service_modules={"encoder": FAULT_WORKERS},
        EPD_ACK_WAIT_S="3",
        EPD_MAX_DELIVER="10",
        EPD_EC_WAIT_S="300",
        EPD_ENCODE_STEALS="0",  # the encoder's redelivery under test: the prefill worker does not take its job
        EPD_NO_ENCODER_AFTER_S="300",  # ... nor encode it itself while no encoder beats (the new one loading)
    )
    stack = running.stack
    try:
        slow = next(p for p in stack.processes if p.name == "encoder")

        image = noise_image(71, (64, 48))
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(api_tokens, running, TEXT, [image], timeout=600)
            _wait_for_log(slow, "fault injection", timeout=120)  # the slow encoder holds the job
            # the replacement first: with no encoder alive the prefill worker would encode the image
            # itself at once (encoders scaled to zero, issue 44) - the redelivery is under test here
            fast = stack.add("encoder", index=1, extra_env={ENCODE_DELAY_ENV: "0"})
            slow.stop(sig=signal.SIGKILL)
            tokens, body = future.result(timeout=600)
        assert tokens == reference_tokens(reference_engine, TEXT, [image])

        item = content_hash_of(image)
        ready = [m for m in running.messages_of("stream_events", ECReady, body["id"]) if m.item_hash == item]
        # Only the new worker produced the features (at least once: JetStream delivers at least
        # once); the killed one never finished its copy of the job.
        assert ready and {m.producer for m in ready} == {worker_id_from_log(fast)}, ready
        final = final_result(running, body["id"])  # exactly one
        assert final.ec_sources[item] == "store"  # the redelivered job's output, not a local fallback
    finally:
        stack.stop()


def test_sigterm_drains_the_job_in_flight(nats_server, s3_server, tiny_model_dir, reference_engine, tmp_path):
    """SIGTERM stops fetching but finishes the job in hand, acks it and exits 0."""
    # The encoder holds the job for 15 s: SIGTERM must arrive while it does, also on a loaded
    # machine where seeing the log line and sending the signal may take seconds. The prefill
    # worker waits for the drained encoder's output (EPD_EC_WAIT_S) instead of encoding locally.
    running = start_stack(
        nats_server,
        s3_server,
        tiny_model_dir,
        tmp_path / "logs",
        service_env={"encoder": {ENCODE_DELAY_ENV: "15"}},
        service_modules={"encoder": FAULT_WORKERS},
        EPD_EC_WAIT_S="300",
        EPD_ENCODE_STEALS="0",  # the encoder's drain under test: the prefill worker does not take its job
    )
    stack = running.stack
    try:
        encoder = next(p for p in stack.processes if p.name == "encoder")
        image = noise_image(72, (56, 56))
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(api_tokens, running, TEXT, [image], timeout=300)
            _wait_for_log(encoder, "fault injection", timeout=120)
            encoder.popen.send_signal(signal.SIGTERM)
            assert encoder.popen.wait(timeout=120) == 0
            tokens, body = future.result(timeout=300)
        assert tokens == reference_tokens(reference_engine, TEXT, [image])
        log_text = encoder.log_path.read_text()
        assert "draining" in log_text and "waiting for 1 in-flight job" in log_text
        item = content_hash_of(image)
        ready = [m for m in running.messages_of("stream_events", ECReady, body["id"]) if m.item_hash == item]
        assert len(ready) == 1 and ready[0].producer == worker_id_from_log(encoder), ready
        assert final_result(running, body["id"]).ec_sources[item] == "store"
    finally:
        stack.stop()


def worker_id_from_log(proc) -> str:
    for line in proc.log_path.read_text().splitlines():
        if "consuming" in line and "encoder worker" in line:
            return line.split("encoder worker ", 1)[1].split(" ", 1)[0]
    raise AssertionError("encoder worker id not found in its log")


def _wait_for_log(proc, needle: str, timeout: float) -> None:
    def seen() -> bool:
        assert proc.alive(), proc.log_tail()
        return needle in proc.log_path.read_text(errors="replace")

    wait_for(seen, timeout, f"{needle!r} in {proc.log_path}")
