"""Shared pytest fixtures: real NATS (JetStream) and S3 (SeaweedFS) servers, started once.

Both servers are session-scoped (SeaweedFS needs ~1 s to start and 2-4 s to stop); tests
isolate themselves with unique stream names / a fresh bucket per test.
"""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Iterator

import pytest

from shared.store.objects import S3ObjectStore
from shared.tools.infra import EmbeddedNats, EmbeddedS3
from tests.stackutil import VLLM_TIERS, require_vllm_tier, set_running_test_markers, start_stack


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Keep the tiers honest: a test that starts vLLM must be marked ``vllm``
    (``make test-vllm``; ``make test`` starts none). Checked before the test's fixtures are set up, by the
    fixtures it needs (a fixture that starts vLLM is named ``vllm_*`` or needs one, and
    ``item.fixturenames`` lists them all), and then by the helpers that start vLLM
    (``require_vllm_tier``, from the markers recorded here), which also catch a test starting it
    without such a fixture."""
    markers = {m.name for m in item.iter_markers()}
    set_running_test_markers(markers)
    if not markers & VLLM_TIERS:
        used = sorted(name for name in item.fixturenames if name.startswith("vllm_"))
        if used:
            pytest.fail(f"uses {', '.join(used)} (vLLM) but is not marked `vllm`", pytrace=False)


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedNats]:
    """A JetStream-enabled nats-server on random ports (``.url``, ``.monitor_url``)."""
    # Each test's streams reserve their max bytes against the server's file store limit, never
    # released in a session: the default limit (75% of the free disk) ran out on a CI machine.
    server = EmbeddedNats(tmp_path_factory.mktemp("nats"), max_file_store=2**50)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedS3]:
    """A SeaweedFS S3 server on random ports (``.endpoint``, ``.access_key``, ``.secret_key``)."""
    server = EmbeddedS3(
        tmp_path_factory.mktemp("s3"),
        access_key=f"epdtest{secrets.token_hex(4)}",
        secret_key=secrets.token_urlsafe(24),
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def claims_env(nats_server):
    """(NATS URL, Subjects, NatsSettings) under a prefix of this test's own: key-value buckets and
    streams that no other test sees."""
    from shared.config import NatsSettings
    from shared.protocol import Subjects

    prefix = f"t{uuid.uuid4().hex[:8]}"
    # (JetStream reserves each stream's max bytes up front: many tests share one server)
    settings = NatsSettings(nats_url=nats_server.url, subject_prefix=prefix, stream_max_bytes=8 * 1024**2)
    return nats_server.url, Subjects(prefix), settings


@pytest.fixture
def s3_store(s3_server: EmbeddedS3) -> Iterator[S3ObjectStore]:
    """An :class:`S3ObjectStore` on a fresh, empty bucket of ``s3_server``."""
    bucket = f"epd-test-{uuid.uuid4().hex[:16]}"
    store = S3ObjectStore(s3_server.endpoint, s3_server.access_key, s3_server.secret_key, bucket)
    store.ensure_bucket()
    yield store
    try:
        for info in list(store.list("")):
            store.delete(info.key)
    except Exception:  # noqa: BLE001 - cleanup only; the server's data dir is temporary
        pass


# -- models and service stacks ------------------------------------------------------------------
@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory):
    """The tiny random-weight Qwen2-VL model, built once per session."""
    from shared.tools.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "qwen2-vl-tiny", arch="qwen2_vl", size="tiny", seed=0)


@pytest.fixture(scope="session")
def vllm_work_dir(tmp_path_factory):
    """One project-local folder for every vLLM engine of the session (caches, IPC sockets). Short,
    because vLLM puts unix sockets there (108-byte path limit)."""
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="session")
def vllm_reference(tiny_model_dir, vllm_work_dir):
    """The aggregated vLLM reference: a plain vLLM engine (no EC connector) in this process."""
    from shared.engines.vllm_engine import VllmEngine

    require_vllm_tier("vllm_reference")
    engine = VllmEngine(tiny_model_dir, dtype="float32", model_id="qwen2-vl-tiny", work_dir=vllm_work_dir)
    try:
        yield engine
    finally:
        from tests.vllmutil import close_engine

        close_engine(engine)


@pytest.fixture(scope="session")
def reference_engine(tiny_model_dir):
    """The aggregated reference: the transformers engine in this process, 1 thread like the workers."""
    from shared.engines.transformers_engine import TransformersEngine

    return TransformersEngine(tiny_model_dir, dtype="float32", threads=1, model_id="qwen2-vl-tiny")


@pytest.fixture(scope="session")
def epd_stack(nats_server, s3_server, tiny_model_dir, tmp_path_factory):
    """api + encoder + prefill(pd) processes on the session's NATS and S3, tiny Qwen2-VL."""
    from shared.tools.infra import free_port

    metrics_port = free_port()
    running = start_stack(
        nats_server,
        s3_server,
        tiny_model_dir,
        tmp_path_factory.mktemp("epd-stack-logs"),
        # Encode stealing off (the default is on): its tests pause the encoder to hold a request
        # waiting for features (test_metrics) and count what the encoder produced (test_e2e_epd);
        # the default is the other stacks' (test_demo_model's on every topology and engine,
        # test_routing's, test_epd_up's, the vLLM stacks).
        # and with the encoder paused, the worker keeps waiting for it (no encoder-less shortcut)
        service_env={
            "prefill": {
                "EPD_METRICS_PORT": str(metrics_port),
                "EPD_ENCODE_STEALS": "0",
                "EPD_NO_ENCODER_AFTER_S": "300",
            }
        },
        EPD_MAX_IMAGES_PER_REQUEST="2",
        EPD_MAX_IMAGE_BYTES=str(512 * 1024),
    )
    running.prefill_metrics_port = metrics_port
    try:
        yield running
    finally:
        running.stack.stop()


@pytest.fixture(scope="module")
def api_only_stack(nats_server, s3_server, tiny_model_dir, tmp_path_factory):
    """Just the API (no workers), with API keys and a short request deadline."""
    running = start_stack(
        nats_server,
        s3_server,
        tiny_model_dir,
        tmp_path_factory.mktemp("api-only-logs"),
        services=["api"],
        roles={},
        EPD_API_KEYS="sk-test-1, sk-test-2",
        EPD_REQUEST_TIMEOUT_S="2",
    )
    running.request_timeout_s = 2
    try:
        yield running
    finally:
        running.stack.stop()


@pytest.fixture(scope="session")
def epd_stack_epd(nats_server, s3_server, tiny_model_dir, tmp_path_factory):
    """E|P|D: api + encoder + prefill (role ``prefill``) + decode processes, tiny Qwen2-VL, on a
    NATS server of its own where each service connects as its role's identity (``shared.nats_auth``).

    An ack wait of 15 s: a killed decode worker's job is redelivered within it, and a worker
    starved of CPU on a loaded machine (it sends ``in_progress`` every ack_wait/3) keeps its job.
    Decode workers sleep 50 ms after each step (fault injection, ``tests.fault_workers``; numerics
    unchanged) so a test can act while a request is being decoded. Tests may stop and start decode
    workers (``stack.add("decode", ...)``) but leave one running."""
    from tests import fault_workers

    running = start_stack(
        nats_server,
        s3_server,
        tiny_model_dir,
        tmp_path_factory.mktemp("epd-split-logs"),
        topology="e-p-d",
        service_env={"decode": {fault_workers.DECODE_STEP_DELAY_ENV: "0.05"}},
        service_modules={"decode": fault_workers.MODULE},
        EPD_MAX_IMAGES_PER_REQUEST="2",
        EPD_MAX_IMAGE_BYTES=str(512 * 1024),
        EPD_ACK_WAIT_S="15",
        EPD_ENCODE_STEALS="0",  # as epd_stack: test_vllm_metrics pauses the encoder to hold a request
        EPD_NO_ENCODER_AFTER_S="300",  # ... and the worker keeps waiting for the paused encoder
        # each service as its own NATS role identity (shared.nats_auth), as `epd up` runs them
        nats_identities=True,
    )
    try:
        yield running
    finally:
        running.stop()
