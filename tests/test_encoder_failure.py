"""An encoder worker killed mid-job: the job is redelivered to another worker and the request completes."""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from shared.protocol import ECReady, FinalResult
from shared.media import content_hash_of
from tests.stackutil import start_stack
from tests.stackutil import data_url, noise_image, user_message
from tests.test_e2e_epd import GREEDY, reference_tokens

pytestmark = pytest.mark.slow


def test_killed_encoder_job_is_redelivered(nats_server, s3_server, tiny_model_dir, reference_engine, tmp_path):
    running = start_stack(nats_server, s3_server, tiny_model_dir, tmp_path / "logs",
                           service_env={"encoder": {"EPD_FAULT_ENCODE_DELAY_S": "60"}},
                           EPD_ACK_WAIT_S="3", EPD_EC_WAIT_S="120")
    stack = running.stack
    try:
        slow = next(p for p in stack.processes if p.name == "encoder")

        image = noise_image(71, (64, 48))
        text = "Describe the image."
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(lambda: running.chat([user_message(text, [data_url(image)])], timeout=180, **GREEDY))
            _wait_for_log(slow, "fault injection", timeout=60)  # the slow encoder holds the job
            slow.stop(sig=signal.SIGKILL)
            fast = stack.add("encoder", index=1, extra_env={"EPD_FAULT_ENCODE_DELAY_S": "0"})
            resp = future.result(timeout=180)
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["choices"][0]["token_ids"] == reference_tokens(reference_engine, text, [image])

        item = content_hash_of(image)
        ready = [m for _, _, m in running.stream_messages("stream_events") if isinstance(m, ECReady) and m.item_hash == item]
        assert [m.producer for m in ready] == [worker_id_from_log(fast)]
        final = next(m for _, _, m in running.stream_messages("stream_results")
                     if isinstance(m, FinalResult) and m.request_id == body["id"])
        assert final.ec_sources[item] == "store"  # the redelivered job's output, not a local fallback
    finally:
        stack.stop()


def test_sigterm_drains_the_job_in_flight(nats_server, s3_server, tiny_model_dir, reference_engine, tmp_path):
    """SIGTERM stops fetching but finishes the job in hand, acks it and exits 0."""
    running = start_stack(nats_server, s3_server, tiny_model_dir, tmp_path / "logs",
                           service_env={"encoder": {"EPD_FAULT_ENCODE_DELAY_S": "4"}})
    stack = running.stack
    try:
        encoder = next(p for p in stack.processes if p.name == "encoder")
        image = noise_image(72, (56, 56))
        text = "Describe the image."
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(lambda: running.chat([user_message(text, [data_url(image)])], timeout=120, **GREEDY))
            _wait_for_log(encoder, "fault injection", timeout=60)
            encoder.popen.send_signal(signal.SIGTERM)
            assert encoder.popen.wait(timeout=60) == 0
            resp = future.result(timeout=120)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["token_ids"] == reference_tokens(reference_engine, text, [image])
        log_text = encoder.log_path.read_text()
        assert "draining" in log_text and "waiting for 1 in-flight job" in log_text
        item = content_hash_of(image)
        ready = [m for _, _, m in running.stream_messages("stream_events") if isinstance(m, ECReady) and m.item_hash == item]
        assert len(ready) == 1 and ready[0].producer == worker_id_from_log(encoder)
    finally:
        stack.stop()


def worker_id_from_log(proc) -> str:
    for line in proc.log_path.read_text().splitlines():
        if "consuming" in line and "encoder worker" in line:
            return line.split("encoder worker ", 1)[1].split(" ", 1)[0]
    raise AssertionError("encoder worker id not found in its log")


def _wait_for_log(proc, needle: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if needle in proc.log_path.read_text(errors="replace"):
            return
        assert proc.alive(), proc.log_tail()
        time.sleep(0.2)
    raise AssertionError(f"{needle!r} not in {proc.log_path}:\n{proc.log_tail()}")
