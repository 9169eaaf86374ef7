"""Every error a decode worker (transformers engine, E|P|D) sends, end to end.

The ``ErrorEvent`` s of ``services/decode/handler.py`` (the vLLM connector path is tested with
the vLLM stacks):

============================  ======  =====================================================
``model_mismatch``            500     the job was prefilled by another model
``deadline_exceeded``         504     the deadline passed before a decode worker took the job
``deadline_exceeded``         504     the deadline passed while decoding
``engine_error`` (EPDError)   500     the batched decode step failed (the only ``EPDError``
                                      that can reach that handler in a correct deployment:
                                      params were already validated by prefill, KV shapes are
                                      checked when the state is built)
``kv_unavailable``            502     the KV object was unusable after ``EPD_MAX_REPREFILLS``
============================  ======  =====================================================

Each is checked on the token subject (the event decodes and carries code, status and stage),
and the ones a real deployment can reach through the HTTP API are checked there too: the client
gets the worker's status and code PROMPTLY - the request deadline of this module's stack is
``REQUEST_TIMEOUT_S`` and the answer must come within ``ANSWER_BOUND_S`` (a bound that only
catches the old failure: an undecodable ``ErrorEvent`` the API dropped, leaving the client to
its deadline and a 504). The two deadline errors are not checked through the API: the API's own
deadline fires at the same moment with the same 504, so the client cannot tell them apart.

One E|P|D stack for the module; each test picks the decode worker it needs (``DecoderSlot``):
one of another model, one whose ``EPD_MAX_KV_OBJECT_BYTES`` no KV object fits, a slow one, one
that sweeps often. The KV sweeper test lives here for the same reason: its decode worker deletes
every KV object older than its TTL in the namespace, so it must not run beside other tests.
"""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import msgspec
import pytest

from shared.fingerprint import model_fingerprint
from shared.protocol import DecodeJob, ErrorEvent, FinalResult, GenerationJob, SamplingSpec
from shared.store.kv import decode_kv_object, encode_kv_object
from shared.store.objects import S3ObjectStore
from shared.tools.launcher import ServiceProcess
from tests import fault_workers
from tests.stackutil import (
    GREEDY,
    data_url,
    decoders,
    engine_messages,
    kv_keys,
    noise_image,
    run_job,
    start_decoder,
    start_stack,
    stop_decoders,
    user_message,
    wait_for,
)

log = logging.getLogger(__name__)

pytestmark = pytest.mark.slow

#: The request deadline of this module's stack (``EPD_REQUEST_TIMEOUT_S``).
REQUEST_TIMEOUT_S = 600
#: An error answer must arrive within this (far below the deadline: a 504 at the deadline is the bug).
ANSWER_BOUND_S = 120
#: ``EPD_MAX_REPREFILLS`` (the default).
MAX_REPREFILLS = 2


# -- the module's stack and its decode worker -----------------------------------------------------
@pytest.fixture(scope="module")
def stack(nats_server, s3_server, tiny_model_dir, tmp_path_factory):
    """E|P|D on the tiny Qwen2-VL with a long request deadline."""
    running = start_stack(
        nats_server,
        s3_server,
        tiny_model_dir,
        tmp_path_factory.mktemp("decode-errors-logs"),
        topology="e-p-d",
        service_modules={"decode": fault_workers.MODULE},  # (a slow decode worker when a test asks)
        EPD_REQUEST_TIMEOUT_S=str(REQUEST_TIMEOUT_S),
        EPD_MAX_REPREFILLS=str(MAX_REPREFILLS),
    )
    running.request_timeout_s = REQUEST_TIMEOUT_S
    try:
        yield running
    finally:
        running.stack.stop()


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory):
    """The tiny Qwen2-VL with other weights (seed 1): another model fingerprint."""
    from shared.tools.models.tiny import build_tiny_model

    return build_tiny_model(
        tmp_path_factory.mktemp("models") / "qwen2-vl-tiny-seed1", arch="qwen2_vl", size="tiny", seed=1
    )


@pytest.fixture(scope="module")
def store(stack, s3_server):
    return S3ObjectStore(s3_server.endpoint, s3_server.access_key, s3_server.secret_key, stack.bucket)


@pytest.fixture(scope="module")
def fingerprint(tiny_model_dir):
    """The model fingerprint of the stack's prefill (and normal decode) workers."""
    return model_fingerprint(tiny_model_dir, dtype="float32", engine="transformers")


class DecoderSlot:
    """The one decode worker of the module's stack, swapped for one with other settings."""

    def __init__(self, stack):
        self.stack = stack
        self.env: dict[str, str] | None = {}  # the stack's own decode worker: no extra env

    def use(self, **env: str) -> ServiceProcess:
        """Exactly one decode worker runs, started with ``env`` (over the stack's), and it is
        ready (its setup - model, KV store, sweeper - is done)."""
        env = {k: str(v) for k, v in env.items()}
        live = decoders(self.stack)
        if len(live) == 1 and self.env == env:
            return live[0]
        self.stop()
        proc = start_decoder(self.stack, **env)
        self.env = env

        def ready():
            assert proc.alive(), f"decode worker exited:\n{proc.log_tail()}"
            return "decode worker ready" in proc.log_path.read_text()

        wait_for(ready, 300, f"decode worker {env} to be ready")
        return proc

    def stop(self) -> None:
        stop_decoders(self.stack)
        self.env = None


@pytest.fixture(scope="module")
def slot(stack):
    return DecoderSlot(stack)


# -- helpers --------------------------------------------------------------------------------------
IMAGE = noise_image(401, (56, 56))
TEXT = "Describe the image."


def _chat(stack, **params) -> httpx.Response:
    """A chat request that must be answered within ``ANSWER_BOUND_S`` (the deadline is far later)."""
    started = time.monotonic()
    try:
        resp = stack.chat([user_message(TEXT, [data_url(IMAGE)])], timeout=ANSWER_BOUND_S, **{**GREEDY, **params})
    except httpx.TimeoutException:
        pytest.fail(
            f"no answer within {ANSWER_BOUND_S}s (the request deadline is {REQUEST_TIMEOUT_S}s): "
            "the decode worker's error did not reach the client"
        )
    log.info("answered %d after %.1fs", resp.status_code, time.monotonic() - started)
    return resp


def _new_request_ids(stack, before: set[str]) -> set[str]:
    """Request ids of the GenerationJobs published since ``before`` was taken."""
    return {
        m.request_id
        for _, _, m in stack.stream_messages("stream_generate")
        if isinstance(m, GenerationJob) and m.request_id not in before
    }


def _generation_ids(stack) -> set[str]:
    return _new_request_ids(stack, set())


def _assert_error_response(resp: httpx.Response, status: int, code: str) -> dict:
    assert resp.status_code == status, (resp.status_code, resp.text)
    error = resp.json()["error"]
    assert error["code"] == code, error
    return error


def _error_on_record(stack, request_id: str) -> ErrorEvent:
    """The one terminal event of ``request_id`` on its token subject: an ErrorEvent."""
    events = stack.messages_of("stream_results", (FinalResult, ErrorEvent), request_id)
    assert len(events) == 1 and isinstance(events[0], ErrorEvent), events
    return events[0]


def _crafted_decode_job(
    stack,
    fingerprint: str,
    request_id: str,
    *,
    reprefill: int = 0,
    deadline: float | None = None,
    model_fingerprint: str | None = None,
) -> DecodeJob:
    """A DecodeJob as a prefill worker publishes it (text only, 8 greedy tokens)."""
    deadline = time.time() + REQUEST_TIMEOUT_S if deadline is None else deadline
    fp = model_fingerprint or fingerprint
    sampling = SamplingSpec(temperature=0, max_tokens=8, ignore_eos=True)
    gen = GenerationJob(
        request_id=request_id,
        model="qwen2-vl-tiny",
        messages=engine_messages("Hello", 0),
        images=(),
        fingerprint="x",
        sampling=sampling,
        stream=False,
        deadline=deadline,
        created_at=time.time(),
        reprefill=reprefill,
    )
    return DecodeJob(
        request_id=request_id,
        kv_key=f"{stack.namespace}/kv/{fp}/{request_id}-{reprefill}",
        kv_attempt=reprefill,
        kv_nbytes=1,
        model_fingerprint=fp,
        sampling=sampling,
        deadline=deadline,
        created_at=time.time(),
        emitted=1,
        emitted_text="",
        prompt_tokens=5,
        generation=gen,
    )


def _rid(what: str) -> str:
    return f"test-{what}-{time.time_ns()}"


# -- on the token subject (crafted jobs, the stack's own decode worker) ----------------------------
def test_job_of_another_model_ends_with_model_mismatch(stack, slot, store, fingerprint):
    """A DecodeJob prefilled by another model: ``model_mismatch`` (500), no re-prefill, and its
    KV object (which no decode worker of this model will ever read) is deleted."""
    slot.use()
    rid = _rid("othermodel")
    job = _crafted_decode_job(stack, fingerprint, rid, model_fingerprint="0" * 24)
    store.put(job.kv_key, b"another model's KV object")
    outcome = run_job(stack, stack.subjects.decode_jobs, job, timeout=ANSWER_BOUND_S)
    event = outcome.terminal
    assert isinstance(event, ErrorEvent), event
    assert (event.code, event.http_status, event.stage) == ("model_mismatch", 500, "decode")
    assert "0" * 24 in event.message and fingerprint in event.message, event.message
    assert outcome.chunks == []
    assert stack.messages_of("stream_generate", GenerationJob, rid) == []  # no re-prefill
    wait_for(lambda: not store.exists(job.kv_key), 60, "the refused job's KV object to be deleted")


def test_deadline_passed_before_a_decode_worker_took_the_job(stack, slot, store, fingerprint):
    slot.use()
    rid = _rid("late")
    job = _crafted_decode_job(stack, fingerprint, rid, deadline=time.time() - 1)
    store.put(job.kv_key, b"the expired request's KV object")
    outcome = run_job(stack, stack.subjects.decode_jobs, job, timeout=ANSWER_BOUND_S)
    event = outcome.terminal
    assert isinstance(event, ErrorEvent), event
    assert (event.code, event.http_status, event.stage) == ("deadline_exceeded", 504, "decode")
    assert "before a decode worker took it" in event.message, event.message
    assert outcome.chunks == []
    wait_for(lambda: not store.exists(job.kv_key), 60, "the expired request's KV object to be deleted")
    # A job is not trusted on this path (nothing loads its object): a key that is not a KV
    # object's is left alone.
    rid = _rid("late-forged")
    forged = f"{stack.namespace}/ec/{rid}"
    store.put(forged, b"not a KV object")
    job = msgspec.structs.replace(_crafted_decode_job(stack, fingerprint, rid, deadline=time.time() - 1), kv_key=forged)
    event = run_job(stack, stack.subjects.decode_jobs, job, timeout=ANSWER_BOUND_S).terminal
    assert isinstance(event, ErrorEvent) and event.code == "deadline_exceeded", event
    # (the worker deletes after it sent the event: wait until it has done either)
    wait_for(
        lambda: f"not deleting {forged}" in stack.log_of("decode") or not store.exists(forged),
        60,
        "the worker to delete the object or to refuse to",
    )
    assert store.exists(forged), "a key outside the KV objects was deleted"
    store.delete(forged)


def test_missing_kv_object_after_the_last_reprefill_ends_with_kv_unavailable(stack, slot, fingerprint):
    """A KV object that is missing again after the last allowed re-prefill ends the request with
    ``kv_unavailable`` (502) instead of looping."""
    slot.use()
    rid = _rid("bounded")
    job = _crafted_decode_job(stack, fingerprint, rid, reprefill=MAX_REPREFILLS)  # (no object at its key)
    outcome = run_job(stack, stack.subjects.decode_jobs, job, timeout=ANSWER_BOUND_S)
    event = outcome.terminal
    assert isinstance(event, ErrorEvent), event
    assert (event.code, event.http_status, event.stage) == ("kv_unavailable", 502, "decode")
    assert "not_found" in event.message and f"after {MAX_REPREFILLS} re-prefill(s)" in event.message, event.message
    assert stack.messages_of("stream_generate", GenerationJob, rid) == []  # no further prefill
    # Control: one re-prefill earlier, the same miss sends the request back to prefill instead.
    rid2 = _rid("bounded-control")
    earlier = _crafted_decode_job(stack, fingerprint, rid2, reprefill=MAX_REPREFILLS - 1)
    # (the re-prefilled request is text only and runs to its end: 8 tokens)
    outcome = run_job(stack, stack.subjects.decode_jobs, earlier, timeout=ANSWER_BOUND_S)
    assert isinstance(outcome.terminal, FinalResult), outcome.terminal
    assert [g.reprefill for g in stack.messages_of("stream_generate", GenerationJob, rid2)] == [MAX_REPREFILLS]


def test_deadline_passed_during_decoding(stack, slot, store):
    """A slow decode worker (0.25 s per step) still decoding at the deadline: it stops, sends
    ``deadline_exceeded`` (504) after the tokens it streamed, and deletes the KV object."""
    slot.use(**{fault_workers.DECODE_STEP_DELAY_ENV: "0.25"})
    rid = _rid("slow")
    sampling = SamplingSpec(temperature=0, max_tokens=2000, ignore_eos=True)  # >= 500 s at 0.25 s per step
    deadline = time.time() + 20  # prefill (one short text prompt) and the first decode steps fit well within
    gen = GenerationJob(
        request_id=rid,
        model="qwen2-vl-tiny",
        messages=engine_messages("Tell me a long story.", 0),
        images=(),
        fingerprint="x",
        sampling=sampling,
        stream=True,
        deadline=deadline,
        created_at=time.time(),
    )
    outcome = run_job(stack, stack.subjects.generate_jobs, gen, timeout=ANSWER_BOUND_S)
    event = outcome.terminal
    assert isinstance(event, ErrorEvent), event
    assert (event.code, event.http_status, event.stage) == ("deadline_exceeded", 504, "decode"), event
    assert "during decoding" in event.message, event.message
    assert time.time() >= deadline  # (not an early failure)
    assert max(c.seq for c in outcome.chunks) >= 1, "the decode worker streamed no token before the deadline"
    (job,) = stack.messages_of("stream_decode", DecodeJob, rid)
    wait_for(lambda: not store.exists(job.kv_key), 60, "the timed-out request's KV object to be deleted")


# -- through the API: the client gets the worker's error, long before the deadline ----------------
def _rewrite_kv_state(store, key: str, **changes) -> None:
    """Replace fields of a KV object's decode state, keeping it a VALID object (schema, model
    fingerprint, request, attempt, checksums): what a buggy prefill worker would have written."""
    fp, name = key.split("/")[-2:]
    rid, attempt = name.rsplit("-", 1)
    obj = decode_kv_object(store.get(key, max_bytes=1 << 30), fingerprint=fp, request_id=rid, attempt=int(attempt))
    state = {**obj.state, **changes}
    blob = encode_kv_object(
        obj.tensors,
        state_metadata={**obj.state_metadata, "state": json.dumps(state)},
        sampling=obj.sampling,
        fingerprint=fp,
        request_id=rid,
        attempt=int(attempt),
        producer=obj.producer,
    )
    store.put(key, blob, metadata=store.stat(key).metadata)


def test_engine_failure_while_decoding_reaches_the_client(stack, slot, store):
    """The batched decode step fails (EngineError): the client gets 500 ``engine_error`` with the
    worker's message. Triggered by a KV object that passes every check (checksums, model, shapes)
    but whose last token is outside the vocabulary, so the model's embedding lookup fails."""
    slot.stop()  # the KV object waits in the store until a decode worker runs
    existing = kv_keys(store, stack)
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(_chat, stack)
        new = wait_for(lambda: kv_keys(store, stack) - existing, ANSWER_BOUND_S, "the KV object")
        (key,) = new
        _rewrite_kv_state(store, key, last_token=2**31 - 1)
        slot.use()
        resp = future.result()
    error = _assert_error_response(resp, 500, "engine_error")
    assert error["message"].startswith("EngineError: batched decode failed"), error
    rid = key.rsplit("/", 1)[1].rsplit("-", 1)[0]
    event = _error_on_record(stack, rid)
    assert (event.code, event.http_status, event.stage) == ("engine_error", 500, "decode")
    assert stack.messages_of("stream_generate", GenerationJob, rid)[0].reprefill == 0
    assert len(stack.messages_of("stream_generate", GenerationJob, rid)) == 1  # not re-prefilled
    wait_for(lambda: not store.exists(key), 60, "the failed request's KV object to be deleted")


def test_decode_worker_of_another_model_reaches_the_client(stack, slot, store, other_model_dir, fingerprint):
    """A decode worker started with another model (a deployment error): every request through
    the API ends promptly with 500 ``model_mismatch``, naming both fingerprints."""
    other = model_fingerprint(other_model_dir, dtype="float32", engine="transformers")
    assert other != fingerprint
    slot.use(EPD_MODEL_PATH=other_model_dir)
    before = _generation_ids(stack)
    existing = kv_keys(store, stack)
    resp = _chat(stack)
    error = _assert_error_response(resp, 500, "model_mismatch")
    assert fingerprint in error["message"] and other in error["message"], error
    (rid,) = _new_request_ids(stack, before)
    event = _error_on_record(stack, rid)
    assert (event.code, event.http_status, event.stage) == ("model_mismatch", 500, "decode")
    wait_for(lambda: not (kv_keys(store, stack) - existing), 60, "the refused request's KV object to be deleted")


def test_kv_objects_too_large_for_the_decode_worker_reach_the_client(stack, slot, store):
    """A decode worker whose ``EPD_MAX_KV_OBJECT_BYTES`` no KV object fits: every attempt is
    re-prefilled until the bound, then the client gets 502 ``kv_unavailable`` - promptly."""
    slot.use(EPD_MAX_KV_OBJECT_BYTES="1024")
    before = _generation_ids(stack)
    resp = _chat(stack)
    error = _assert_error_response(resp, 502, "kv_unavailable")
    assert "too_large" in error["message"] and f"after {MAX_REPREFILLS} re-prefill(s)" in error["message"], error
    (rid,) = _new_request_ids(stack, before)
    event = _error_on_record(stack, rid)
    assert (event.code, event.http_status, event.stage) == ("kv_unavailable", 502, "decode")
    gens = stack.messages_of("stream_generate", GenerationJob, rid)
    assert sorted(g.reprefill for g in gens) == list(range(MAX_REPREFILLS + 1))
    jobs = stack.messages_of("stream_decode", DecodeJob, rid)
    assert sorted(j.kv_attempt for j in jobs) == list(range(MAX_REPREFILLS + 1))
    assert all(j.kv_nbytes > 1024 for j in jobs)
    wait_for(lambda: not {k for k in kv_keys(store, stack) if rid in k}, 60, "every KV object to be deleted")


# -- the KV sweeper -------------------------------------------------------------------------------
SWEEP_TTL_S = 24  # the young object is written TTL/2 later: 12 s of slack for a slow sweep under load


def test_kv_sweeper_deletes_orphans_older_than_the_ttl_and_keeps_younger_ones(stack, slot, store, fingerprint):
    """A decode worker sweeping every 0.5 s with a TTL of ``SWEEP_TTL_S`` deletes an orphaned KV
    object once it is older than the TTL, and keeps one younger than the TTL until it is old too.

    ``KVStore.sweep`` ages an object by the S3 server's last-modified time (set by the PUT), so
    ages here are real wall-clock time on this machine's clock: the young object is written
    ``SWEEP_TTL_S / 2`` after the old one and must still be there when the old one is gone."""
    slot.use(EPD_KV_SWEEP_INTERVAL_S="0.5", EPD_KV_TTL_S=str(SWEEP_TTL_S))
    prefix = f"{stack.namespace}/kv/{fingerprint}"
    old, young = f"{prefix}/orphan-old-{time.time_ns()}-0", f"{prefix}/orphan-young-{time.time_ns()}-0"
    outside = f"{stack.namespace}/other/{fingerprint}/not-a-kv-object-0"  # not under the KV prefix

    store.put(old, b"an orphaned KV object")
    store.put(outside, b"not a KV object")
    old_at = store.stat(old).last_modified
    wait_for(lambda: time.time() - old_at >= SWEEP_TTL_S / 2, 60, "the old object to age")
    assert store.exists(old), "deleted while younger than the TTL"
    store.put(young, b"a younger orphaned KV object")
    young_at = store.stat(young).last_modified

    wait_for(lambda: not store.exists(old), SWEEP_TTL_S + 120, "the old orphan to be swept")
    gone_at = time.time()
    assert gone_at - old_at > SWEEP_TTL_S, "swept before it was older than the TTL"
    assert store.exists(young), "the younger object was swept with the old one"
    assert gone_at - young_at < SWEEP_TTL_S, "(the control needs the young object younger than the TTL here)"
    # The young one goes too once it is old (so it was kept for its age, not for its key) ...
    wait_for(lambda: not store.exists(young), SWEEP_TTL_S + 120, "the young orphan to be swept")
    assert time.time() - young_at > SWEEP_TTL_S
    # ... and only KV objects are swept.
    assert store.exists(outside)
    store.delete(outside)
