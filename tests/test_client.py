"""The request client and the typed subscription on a real NATS server, with the test playing the
workers: what a request publishes (msg ids included), the token stream's one dedup rule, junk
skipping, and the deadline; and a worker's side of the token stream (``shared.token_stream``)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

import nats
import pytest

from shared import protocol
from shared.client import RequestClient, TokenStream, chunk_texts
from shared.config import NatsSettings, WorkerSettings
from shared.ec_lifecycle.index import ECIndex, Use, entry_key
from shared.engines.base import TokenEvent
from shared.errors import DeadlineExceeded, EPDError, PayloadTooLarge, ServiceUnavailable, WorkerFailed
from shared.jetstream import JetStreamPublisher, PendingAck, ensure_topology, subscribe_typed
from shared.protocol import (
    ChatRequestRecord,
    ECFailed,
    ECReady,
    ECWanted,
    EncodeJob,
    ErrorEvent,
    FinalResult,
    GenerationJob,
    ImageRef,
    RequestCancelled,
    SamplingSpec,
    Subjects,
    TokenChunk,
)
from shared.token_stream import TokenOutput
from shared.worker import WorkerContext
from tests.stackutil import until

ITEM = "cd" * 32
REF = ImageRef(item_hash=ITEM, media_key=f"ns/media/{ITEM}", width=8, height=8)


def _job(rid: str, deadline: float, *, messages=None) -> GenerationJob:
    return GenerationJob(
        request_id=rid,
        model="m",
        messages=messages or [{"role": "user", "content": "hi"}],
        images=(),
        fingerprint="fp",
        sampling=SamplingSpec(temperature=0, max_tokens=4),
        stream=False,
        deadline=deadline,
        created_at=time.time(),
    )


def _chunk(rid: str, attempt: int, seq: int, tok: int) -> TokenChunk:
    return TokenChunk(request_id=rid, attempt=attempt, seq=seq, token_ids=(tok,), text=f"<{tok}>")


def _final(rid: str, tokens: tuple[int, ...]) -> FinalResult:
    return FinalResult(
        request_id=rid,
        attempt=2,
        token_ids=tokens,
        text="".join(f"<{t}>" for t in tokens),
        finish_reason="length",
        prompt_tokens=1,
        completion_tokens=len(tokens),
    )


@pytest.fixture
def deployment(nats_server):
    """A fresh subject prefix with its streams on the session's NATS."""
    prefix = f"cl{uuid.uuid4().hex[:8]}"
    settings = NatsSettings(nats_url=nats_server.url, subject_prefix=prefix)
    subjects = Subjects(prefix)

    async def setup():
        nc = await nats.connect(nats_server.url)
        await ensure_topology(nc.jetstream(), settings, subjects)
        await nc.close()

    asyncio.run(setup())
    yield nats_server.url, subjects

    async def teardown():
        nc = await nats.connect(nats_server.url)
        for stream in subjects.streams():
            with contextlib.suppress(nats.js.errors.NotFoundError):  # (a test may have deleted it)
                await nc.jetstream().delete_stream(stream)
        try:
            await nc.jetstream().delete_key_value(subjects.ec_index_bucket)
        except nats.js.errors.NotFoundError:
            pass
        await nc.close()

    asyncio.run(teardown())


async def _client(nc, subjects: Subjects) -> RequestClient:
    return RequestClient(nc, subjects, ec_index=await ECIndex.open(nc.jetstream(), subjects.ec_index_bucket))


async def _worker_takes_job(nc, subjects: Subjects) -> GenerationJob:
    """The generation job as a worker sees it (the last one on the stream)."""
    raw = await nc.jetstream().get_last_msg(subjects.stream_generate, subjects.generate_jobs)
    return protocol.decode(raw.data, GenerationJob)


def test_first_copy_of_each_seq_wins_whatever_the_attempt_and_junk_is_skipped(deployment):
    url, subjects = deployment
    rid = f"chatcmpl-{uuid.uuid4().hex}"

    async def main():
        nc = await nats.connect(url)
        try:
            client = await _client(nc, subjects)
            record = ChatRequestRecord(request_id=rid, received_at=time.time(), model="m", body={})
            stream = await client.submit(_job(rid, time.time() + 30), record=record)
            assert (await _worker_takes_job(nc, subjects)).request_id == rid
            js, tokens = nc.jetstream(), subjects.tokens(rid)
            pub = JetStreamPublisher(js)
            # Attempt 1 streams two tokens and dies; attempt 2 (a redelivery) restarts at seq 0 and
            # - here, to tell the copies apart - says other tokens for the seqs already forwarded.
            for msg in (_chunk(rid, 1, 0, 10), _chunk(rid, 1, 1, 11), _chunk(rid, 2, 0, 90), _chunk(rid, 2, 1, 91)):
                await pub.publish(tokens, msg, request_id=rid)
            await nc.publish(tokens, b"\x93junk")  # undecodable: skipped
            await pub.publish(
                tokens,
                ECFailed(
                    request_id=rid, item_hash=ITEM, fingerprint="fp", code="x", message="wrong type", created_at=0.0
                ),
                request_id=rid,
            )
            for msg in (_chunk(rid, 2, 2, 12), _chunk(rid, 1, 2, 80), _final(rid, (10, 11, 12))):
                await pub.publish(tokens, msg, request_id=rid)
            chunks, final = await stream.collect()
            # The record and the job went out with their msg ids.
            rec = await js.get_last_msg(subjects.stream_requests, subjects.request(rid))
            job = await js.get_last_msg(subjects.stream_generate, subjects.generate_jobs)
            return chunks, final, stream, rec, job
        finally:
            await nc.close()

    chunks, final, stream, rec, job = asyncio.run(main())
    assert [(c.attempt, c.seq, c.token_ids) for c in chunks] == [(1, 0, (10,)), (1, 1, (11,)), (2, 2, (12,))]
    assert chunk_texts(chunks) == ["<10>", "<11>", "<12>"]
    assert isinstance(final, FinalResult) and final.token_ids == (10, 11, 12)
    assert stream.duplicates == 3 and stream.forwarded == 3
    assert stream._sub.skipped == 2  # the undecodable message and the ECFailed
    assert protocol.decode(rec.data, ChatRequestRecord).request_id == rid
    assert rec.headers[protocol.HDR_MSG_ID] == f"{rid}-record"  # (published again: stored once)
    assert job.headers[protocol.HDR_MSG_ID] == rid


def test_events_missed_on_the_subscription_are_read_from_the_stream(deployment, monkeypatch):
    """What a worker published while the API's connection could not hear it (the API moving to
    another NATS server) is in ``<P>_RESULTS``: a chunk past a gap, and a quiet stream, make the
    token stream read it there - the text has no hole, the lost final result still ends it.
    Here the missed events are published before the subscription exists (core NATS drops them)."""
    url, subjects = deployment
    monkeypatch.setattr(TokenStream, "CATCH_UP_IDLE_S", 0.3)
    gap, quiet, control = (f"chatcmpl-{uuid.uuid4().hex}" for _ in range(3))

    async def main():
        nc = await nats.connect(url)
        try:
            client = await _client(nc, subjects)
            pub = JetStreamPublisher(nc.jetstream())
            # 1. seqs 0 and 1 missed, 2 and the final result heard: read 0 and 1 first.
            for msg in (_chunk(gap, 1, 0, 10), _chunk(gap, 1, 1, 11)):
                await pub.publish(subjects.tokens(gap), msg, request_id=gap)
            stream = await client.submit(_job(gap, time.time() + 30))
            for msg in (_chunk(gap, 1, 2, 12), _final(gap, (10, 11, 12))):
                await pub.publish(subjects.tokens(gap), msg, request_id=gap)
            gapped = await stream.collect()
            # 2. everything missed, the final result too: the quiet stream reads it.
            for msg in (_chunk(quiet, 1, 0, 20), _final(quiet, (20,))):
                await pub.publish(subjects.tokens(quiet), msg, request_id=quiet)
            started = time.time()
            stream = await client.submit(_job(quiet, started + 30))
            silent = await stream.collect()
            silent_s = time.time() - started
            # Negative control: without the stream store, a gap is an error, never a hole in the text.
            await pub.publish(subjects.tokens(control), _chunk(control, 1, 0, 30), request_id=control)
            blind = await client.submit(_job(control, time.time() + 30))
            blind._stored = None
            await pub.publish(subjects.tokens(control), _chunk(control, 1, 1, 31), request_id=control)
            with pytest.raises(WorkerFailed, match=r"lost chunks 0\.\.0"):
                await anext(blind)
            return gapped, silent, silent_s
        finally:
            await nc.close()

    (chunks, final), (quiet_chunks, quiet_final), quiet_s = asyncio.run(main())
    assert [(c.seq, c.token_ids) for c in chunks] == [(0, (10,)), (1, (11,)), (2, (12,))]
    assert isinstance(final, FinalResult) and final.token_ids == (10, 11, 12)
    assert [c.token_ids for c in quiet_chunks] == [(20,)] and isinstance(quiet_final, FinalResult)
    assert quiet_s < 10  # the idle catch-up, not the 30 s deadline


def test_a_result_with_more_tokens_than_were_forwarded_reads_the_missed_chunks_first(deployment):
    """A final result arriving after a missed chunk (its tokens say there were more) is held back
    while the chunk is read from the stream: the text has no hole at its end either. Without the
    stream store, such a result is an error, never a silently shorter answer."""
    url, subjects = deployment
    missed, control = (f"chatcmpl-{uuid.uuid4().hex}" for _ in range(2))

    async def main():
        nc = await nats.connect(url)
        try:
            client = await _client(nc, subjects)
            pub = JetStreamPublisher(nc.jetstream())
            await pub.publish(subjects.tokens(missed), _chunk(missed, 1, 0, 10), request_id=missed)  # (unheard)
            stream = await client.submit(_job(missed, time.time() + 30))
            await pub.publish(subjects.tokens(missed), _final(missed, (10,)), request_id=missed)
            caught_up = await stream.collect()
            blind = await client.submit(_job(control, time.time() + 30))
            blind._stored = None
            await pub.publish(subjects.tokens(control), _final(control, (30,)), request_id=control)
            with pytest.raises(WorkerFailed, match=r"lost chunks 0\.\.0"):
                await anext(blind)
            return caught_up
        finally:
            await nc.close()

    chunks, final = asyncio.run(main())
    assert [(c.seq, c.token_ids) for c in chunks] == [(0, (10,))]
    assert isinstance(final, FinalResult) and final.token_ids == (10,)


def test_a_gap_the_store_cannot_fill_yet_is_held_until_its_chunk_comes_or_the_deadline(deployment):
    """A chunk heard past a gap whose missing chunk is not in the stream store yet (its first
    publish died with its stream's leader: the worker publishes it again after the election; or
    a redelivered job repeats it) is held while the store is read again: the text comes whole,
    in order. A gap nothing fills ends at the deadline, saying which tokens it waited for."""
    url, subjects = deployment
    held, never = (f"chatcmpl-{uuid.uuid4().hex}" for _ in range(2))

    async def main():
        nc = await nats.connect(url)
        try:
            client = await _client(nc, subjects)
            pub = JetStreamPublisher(nc.jetstream())
            stream = await client.submit(_job(held, time.time() + 30))
            reads: list[int] = []
            read_store = stream._stored

            async def counted(after_seq: int):
                reads.append(after_seq)
                return await read_store(after_seq)

            stream._stored = counted
            for msg in (_chunk(held, 1, 0, 10), _chunk(held, 1, 2, 12), _final(held, (10, 11, 12))):
                await pub.publish(subjects.tokens(held), msg, request_id=held)
            first = await anext(stream)
            second = asyncio.create_task(anext(stream))
            await until(lambda: len(reads) >= 2 or second.done(), 10, "two reads of the store")  # still held?
            waited = not second.done()
            await pub.publish(subjects.tokens(held), _chunk(held, 1, 1, 11), request_id=held)
            chunks, final = await stream.collect()
            chunks = [first, await second, *chunks]
            started = time.time()
            unfilled = await client.submit(_job(never, started + 1.5))
            await pub.publish(subjects.tokens(never), _chunk(never, 1, 1, 21), request_id=never)
            with pytest.raises(DeadlineExceeded, match=r"waiting for tokens 0\.\.0"):
                await anext(unfilled)
            return waited, chunks, final, time.time() - started
        finally:
            await nc.close()

    waited, chunks, final, unfilled_s = asyncio.run(main())
    assert waited
    assert [(c.seq, c.token_ids) for c in chunks] == [(0, (10,)), (1, (11,)), (2, (12,))]
    assert isinstance(final, FinalResult) and final.token_ids == (10, 11, 12)
    assert 1.0 < unfilled_s < 10


def test_a_result_that_carries_the_last_chunk_is_that_chunk_then_the_result_in_token_order(deployment):
    """``FinalResult.last_chunk``: the token stream forwards the chunk, then the result without it;
    past a gap it is held like a chunk until the gap is filled; a copy of a seq already forwarded
    (a redelivered attempt's) is dropped, the result kept."""
    url, subjects = deployment
    gap, dup = (f"chatcmpl-{uuid.uuid4().hex}" for _ in range(2))

    async def main():
        nc = await nats.connect(url)
        try:
            client = await _client(nc, subjects)
            pub = JetStreamPublisher(nc.jetstream())
            out = {}
            for rid, events in (
                # seq 1 comes after the result that carries seq 2
                (gap, [_chunk(gap, 1, 0, 10), _final(gap, (10, 11, 12)).with_last_chunk(_chunk(gap, 1, 2, 12))]),
                # attempt 1 sent seqs 0 and 1; attempt 2's result carries seq 1 again, told apart by its token
                (
                    dup,
                    [
                        _chunk(dup, 1, 0, 10),
                        _chunk(dup, 1, 1, 11),
                        _final(dup, (10, 11)).with_last_chunk(_chunk(dup, 2, 1, 91)),
                    ],
                ),
            ):
                stream = await client.submit(_job(rid, time.time() + 30))
                for msg in events:
                    await pub.publish(subjects.tokens(rid), msg, request_id=rid)
                first = await anext(stream)
                if rid == gap:
                    held = asyncio.create_task(anext(stream))
                    await until(lambda s=stream: bool(s._held), 10, "the result held past the gap")
                    assert not held.done()
                    await pub.publish(subjects.tokens(rid), _chunk(rid, 1, 1, 11), request_id=rid)
                    rest, final = await stream.collect()
                    out[rid] = ([first, await held, *rest], final, stream.duplicates)
                else:
                    rest, final = await stream.collect()
                    out[rid] = ([first, *rest], final, stream.duplicates)
            return out
        finally:
            await nc.close()

    out = asyncio.run(main())
    chunks, final, duplicates = out[gap]
    assert [(c.seq, c.token_ids) for c in chunks] == [(0, (10,)), (1, (11,)), (2, (12,))]
    assert final.token_ids == (10, 11, 12) and final.last_chunk is None
    chunks, final, duplicates = out[dup]
    assert [(c.seq, c.token_ids) for c in chunks] == [(0, (10,)), (1, (11,))]  # not 91
    assert final.token_ids == (10, 11) and final.last_chunk is None and duplicates == 1


class _LosingPublisher(JetStreamPublisher):
    """A real publisher whose first send of each seq in ``lose`` goes where no stream stores it
    (as if it died with its stream's leader): JetStream never acknowledges it."""

    def __init__(self, js, lose: set[int]):
        super().__init__(js, retry_s=5.0)
        self.lose = lose

    async def send(self, subject, msg, *, request_id) -> PendingAck:
        if msg.seq in self.lose:
            self.lose.discard(msg.seq)
            subject = f"lost.{subject}"
        return await super().send(subject, msg, request_id=request_id)


def test_a_chunk_jetstream_did_not_store_is_published_again_and_the_text_stays_whole(deployment):
    """``TokenOutput``: a chunk whose acknowledgement fails is published again (stored after the
    chunk sent behind it) instead of failing the job; the API's token stream, hearing that later
    chunk first, holds it: the answer is whole and in order."""
    url, subjects = deployment
    rid = f"chatcmpl-{uuid.uuid4().hex}"

    async def main():
        nc = await nats.connect(url)
        try:
            client = await _client(nc, subjects)
            stream = await client.submit(_job(rid, time.time() + 30))
            publisher = _LosingPublisher(nc.jetstream(), {1})
            out = TokenOutput(WorkerContext(WorkerSettings(), subjects, publisher, nc), rid, 1)
            for tok, finish in ((10, None), (11, None), (12, None), (13, "length")):
                await out.publish(TokenEvent(tok, f"<{tok}>", finish_reason=finish))
            await out.end(_final(rid, (10, 11, 12, 13)))
            heard = await stream.collect()
            stored, _ = await client.stored_events(rid, 0)
            return publisher.lose, heard, stored
        finally:
            await nc.close()

    unlost, (chunks, final), stored = asyncio.run(main())
    assert not unlost  # the fault hit: seq 1's first send went nowhere
    assert [c.token_ids for c in chunks] == [(10,), (11,), (12,), (13,)] and final.token_ids == (10, 11, 12, 13)
    seqs = [(type(m).__name__, m.last_chunk.seq if isinstance(m, FinalResult) else m.seq) for m in stored]
    assert seqs == [("TokenChunk", 0), ("TokenChunk", 2), ("TokenChunk", 1), ("FinalResult", 3)]


class _OrderedPublisher(JetStreamPublisher):
    """A real publisher that notes when it sends a chunk, when a chunk is confirmed stored and
    when it publishes anything else."""

    def __init__(self, js, notes: list[str]):
        super().__init__(js, retry_s=0.5)
        self.notes = notes

    async def send(self, subject, msg, *, request_id) -> PendingAck:
        pending = await super().send(subject, msg, request_id=request_id)
        self.notes.append(f"sent {msg.seq}")
        confirmed = pending.confirmed

        async def noted() -> None:
            await confirmed()
            self.notes.append(f"stored {msg.seq}")

        pending.confirmed = noted  # type: ignore[method-assign]  # (noting this one's confirmation)
        return pending

    async def publish(self, subject, msg, **kwargs) -> bool:
        self.notes.append(type(msg).__name__)
        return await super().publish(subject, msg, **kwargs)


def test_a_worker_sends_each_chunk_before_the_last_is_stored_and_the_result_before_its_last_chunk_is(deployment):
    """``TokenOutput``: a chunk goes out before the previous one's acknowledgement is awaited, the
    final result - with the last token, which goes out with it - before the chunk before it is
    stored, and ``end`` returns only once every chunk is stored; the stream stores them in the
    order they were sent. A chunk JetStream cannot store (no stream holds its subject), even
    published again, fails ``end`` / ``flush`` (the job is not acked as done); ``flush`` sends a
    last token held for the result (before a hand-off)."""
    url, subjects = deployment
    rid = f"chatcmpl-{uuid.uuid4().hex}"

    async def main():
        nc = await nats.connect(url)
        try:
            client = await _client(nc, subjects)
            stream = await client.submit(_job(rid, time.time() + 30))
            notes: list[str] = []
            ctx = WorkerContext(WorkerSettings(), subjects, _OrderedPublisher(nc.jetstream(), notes), nc)
            out = TokenOutput(ctx, rid, 1)
            for tok, finish in ((10, None), (11, None), (12, "length")):
                await out.publish(TokenEvent(tok, f"<{tok}>", finish_reason=finish))
            await out.end(_final(rid, (10, 11, 12)))
            heard = await stream.collect()
            stored, _ = await client.stored_events(rid, 0)
            # a chunk on a subject no stream holds: JetStream refuses it
            lost = TokenOutput(WorkerContext(WorkerSettings(), Subjects("nostream"), ctx.publisher, nc), rid, 1)
            await lost.publish(TokenEvent(20, "<20>", finish_reason="length"))
            with pytest.raises(ServiceUnavailable):
                await lost.flush()
            return notes, heard, stored
        finally:
            await nc.close()

    notes, (chunks, final), stored = asyncio.run(main())
    assert notes[:5] == ["sent 0", "sent 1", "stored 0", "FinalResult", "stored 1"]
    assert notes[5] == "sent 0"  # the held last token of the second output, sent by flush
    assert [c.token_ids for c in chunks] == [(10,), (11,), (12,)] and final.token_ids == (10, 11, 12)
    assert final.last_chunk is None  # (the stream forwarded it as a chunk of its own)
    assert [type(m).__name__ for m in stored] == ["TokenChunk"] * 2 + ["FinalResult"]
    assert [m.seq for m in stored[:2]] == [0, 1] and stored[2].last_chunk.token_ids == (12,)
    assert stored[2].v == protocol.LAST_CHUNK_SCHEMA


def test_duplicate_encode_jobs_collapse_and_the_deadline_ends_a_silent_request(deployment):
    url, subjects = deployment
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    job = EncodeJob(request_id=rid, image=REF, fingerprint="fp", ec_key=f"ns/fp/{ITEM}", created_at=time.time())
    abandoned: list[EPDError] = []

    async def on_abandon(error: EPDError) -> None:
        abandoned.append(error)
        await client.abandon(rid, error)

    async def main():
        nonlocal client
        nc = await nats.connect(url)
        try:
            client = await _client(nc, subjects)
            # The same EC object twice (another request, a replay): one job.
            fresh = [
                await client.queue_encode(job),
                await client.queue_encode(
                    EncodeJob(request_id="other", image=REF, fingerprint="fp", ec_key=job.ec_key, created_at=0.0)
                ),
            ]
            info = await nc.jetstream().stream_info(subjects.stream_encode)
            # A request nobody answers ends at its deadline, recorded as abandoned by the API.
            started = time.time()
            stream = await client.submit(_job(rid, started + 0.5), on_abandon=on_abandon)
            with pytest.raises(DeadlineExceeded):
                await anext(stream)
            elapsed = time.time() - started
            with pytest.raises(StopAsyncIteration):  # ended: nothing more, no second deadline
                await anext(stream)
            last = await nc.jetstream().get_last_msg(subjects.stream_results, subjects.tokens(rid))
            cancel = await nc.jetstream().get_last_msg(subjects.stream_control, subjects.cancel(rid))
            wanted = await nc.jetstream().get_last_msg(subjects.stream_control, subjects.ec_wanted("fp", ITEM))
            # Too large for one NATS message: refused before anything is published.
            big = _job("chatcmpl-big", time.time() + 5, messages=[{"role": "user", "content": "x" * nc.max_payload}])
            with pytest.raises(PayloadTooLarge):
                await client.submit(big)
            return (
                fresh,
                info.state.messages,
                elapsed,
                protocol.decode(last.data),
                protocol.decode(cancel.data),
                protocol.decode(wanted.data),
            )
        finally:
            await nc.close()

    client = None
    fresh, queued, elapsed, last, cancel, wanted = asyncio.run(main())
    assert fresh == [True, False] and queued == 1
    assert 0.5 <= elapsed < 5
    assert [e.code for e in abandoned] == ["deadline_exceeded"]
    assert isinstance(last, ErrorEvent) and (last.code, last.stage) == ("deadline_exceeded", "api")
    # The deadline cancels the request's work; the deduplicated request says it wants the job.
    assert isinstance(cancel, RequestCancelled) and (cancel.request_id, cancel.reason) == (rid, "deadline_exceeded")
    assert isinstance(wanted, ECWanted) and (wanted.request_id, wanted.item_hash) == ("other", ITEM)


def test_an_encode_job_for_an_evicted_or_purged_object_is_a_new_job(deployment):
    """Requests that find an EC object missing share one encode job; once the object was stored
    and then removed (evicted or purged: its index entry deleted), asking for it again queues a
    new job at once - within the duplicate window - which requests then share again."""
    url, subjects = deployment
    ec_key = f"ns/fp/{ITEM}"

    def job(rid: str) -> EncodeJob:
        return EncodeJob(request_id=rid, image=REF, fingerprint="fp", ec_key=ec_key, created_at=time.time())

    async def main():
        nc = await nats.connect(url)
        try:
            client = await _client(nc, subjects)
            cold = [await client.queue_encode(job("a")), await client.queue_encode(job("b"))]
            # The encoder stored it (its announcement indexes it); then the janitor or a purge removed it.
            await client.ec_index.record(
                Use(key=ec_key, fingerprint="fp", item_hash=ITEM, at=time.time(), size=8, created=True)
            )
            assert await client.ec_index.remove(entry_key("fp", ITEM), None)
            again = [await client.queue_encode(job("c")), await client.queue_encode(job("d"))]
            js = nc.jetstream()
            info = await js.stream_info(subjects.stream_encode)
            ids = [
                (await js.get_msg(subjects.stream_encode, seq)).headers[protocol.HDR_MSG_ID]
                for seq in range(info.state.first_seq, info.state.last_seq + 1)
            ]
            # Negative control: under the EC key's first generation (what a plain EC-key id was), the
            # new job would have been dropped as a copy of the first one.
            dropped = not await JetStreamPublisher(js).publish(
                subjects.encode_jobs, job("e"), request_id="e", msg_id=protocol.encode_job_msg_id(ec_key, 0)
            )
            return cold, again, ids, dropped
        finally:
            await nc.close()

    cold, again, ids, dropped = asyncio.run(main())
    assert cold == [True, False] and again == [True, False]
    assert len(ids) == 2 and ids[0] == f"{ec_key}@0" and ids[1] != ids[0] and ids[1].startswith(f"{ec_key}@")
    assert dropped


def test_typed_subscription_waits_for_its_types_until_the_deadline(nats_server):
    subject = f"typed.{uuid.uuid4().hex}"
    ready = ECReady(
        request_id="r",
        item_hash=ITEM,
        fingerprint="fp",
        ec_key="k",
        n_tokens=1,
        nbytes=1,
        producer="p",
        encode_s=0.1,
        created_at=0.0,
    )

    async def main():
        nc = await nats.connect(nats_server.url)
        try:
            async with await subscribe_typed(nc, subject, ECReady, ECFailed) as sub:
                await nc.publish(subject, protocol.encode(_chunk("r", 1, 0, 1)))  # another type: skipped
                await nc.publish(subject, b"not msgpack")
                await nc.publish(subject, protocol.encode(ready))
                got = await sub.next(deadline=time.time() + 10)
                started = time.time()
                none = await sub.next(deadline=started + 0.3)
                waited = time.time() - started
                skipped = sub.skipped
            await sub.close()  # closing twice is harmless
            return got, none, waited, skipped
        finally:
            await nc.close()

    got, none, waited, skipped = asyncio.run(main())
    assert got == ready and skipped == 2
    assert none is None and 0.25 <= waited < 3


def test_a_typed_subscription_says_when_a_message_is_queued_and_drops_past_its_bound(nats_server):
    """``ready``: a message arrived and ``next`` returns it without waiting (the API sends what it
    has before waiting for more). Past ``MAX_QUEUED`` unread messages, new ones are dropped and
    counted, the first ones kept in order."""
    subject = f"typed.{uuid.uuid4().hex}"

    async def arrived(sub, n: int) -> None:
        while len(sub._queued) + sub.dropped < n:  # (the subscription's callback queues them)
            await asyncio.sleep(0.005)

    async def main():
        nc = await nats.connect(nats_server.url)
        try:
            async with await subscribe_typed(nc, subject, TokenChunk) as sub:
                sub.MAX_QUEUED = 2
                before = sub.ready
                for seq in range(4):
                    await nc.publish(subject, protocol.encode(_chunk("r", 1, seq, seq)))
                await asyncio.wait_for(arrived(sub, 4), 10)
                after = sub.ready
                got = [await sub.next(deadline=time.time() + 5) for _ in range(2)]
                return before, after, got, sub.ready, sub.dropped
        finally:
            await nc.close()

    before, after, got, drained, dropped = asyncio.run(main())
    assert (before, after, drained) == (False, True, False)
    assert [c.seq for c in got] == [0, 1] and dropped == 2


def test_a_confirmed_subscription_is_on_the_server_when_it_returns(nats_server):
    """``confirm=True`` returns once the server has the subscription, so a message anyone publishes
    after that is delivered (the prefill worker subscribes to an item's ECReady, then checks the
    store: an encoder announcing in between must not be missed). Read from the server's monitoring
    endpoint before this process yields to its event loop again."""
    import json
    import urllib.request

    def registered(subject: str) -> bool:  # blocking on purpose: nats-py's flusher cannot run meanwhile
        with urllib.request.urlopen(f"{nats_server.monitor_url}/subsz?subs=1&limit=100000", timeout=30) as resp:
            subs = json.loads(resp.read()).get("subscriptions_list") or []
        return any(sub["subject"] == subject for sub in subs)

    async def main(confirm: bool) -> bool:
        nc = await nats.connect(nats_server.url)
        try:
            subject = f"confirm.{uuid.uuid4().hex}"
            async with await subscribe_typed(nc, subject, ECReady, confirm=confirm):
                return registered(subject)
        finally:
            await nc.close()

    assert asyncio.run(main(confirm=True))
    # Negative control: without it the SUB is still in the client's buffer.
    assert not asyncio.run(main(confirm=False))


class _RecordPublisher(JetStreamPublisher):
    """A real publisher that notes what it publishes (``publish``); with ``send_fails``, its
    ``send`` of a request record fails the way a NATS leader election fails it."""

    def __init__(self, js, *, send_fails: bool):
        super().__init__(js, retry_s=0.5)
        self.send_fails = send_fails
        self.published: list[str] = []

    async def send(self, subject, msg, *, request_id, msg_id=None) -> PendingAck:
        if self.send_fails and isinstance(msg, ChatRequestRecord):
            raise ServiceUnavailable("no JetStream leader (test)")
        return await super().send(subject, msg, request_id=request_id, msg_id=msg_id)

    async def publish(self, subject, msg, **kwargs) -> bool:
        self.published.append(type(msg).__name__)
        return await super().publish(subject, msg, **kwargs)


def test_a_request_record_that_could_not_be_sent_is_published_again_and_the_request_goes_on(deployment):
    """The record goes out without waiting (``send``) ahead of the job; when that fails it is
    published again, retried like a job, after the job's publish - stored either way, the request
    unaffected. Control: a record sent normally is published once, by ``send``."""
    url, subjects = deployment

    async def main(send_fails: bool) -> tuple[list[str], ChatRequestRecord, str]:
        nc = await nats.connect(url)
        try:
            rid = f"chatcmpl-{uuid.uuid4().hex}"
            client = await _client(nc, subjects)
            client.publisher = publisher = _RecordPublisher(nc.jetstream(), send_fails=send_fails)
            record = ChatRequestRecord(request_id=rid, received_at=time.time(), model="m", body={"n": 1})
            stream = await client.submit(_job(rid, time.time() + 30), record=record)
            await stream.cancel(EPDError("done"))
            raw = await nc.jetstream().get_last_msg(subjects.stream_requests, subjects.request(rid))
            return publisher.published, protocol.decode(raw.data, ChatRequestRecord), rid
        finally:
            await nc.close()

    published, stored, rid = asyncio.run(main(send_fails=True))
    assert published == ["GenerationJob", "ChatRequestRecord"]
    assert stored.request_id == rid and stored.body == {"n": 1}
    published, stored, rid = asyncio.run(main(send_fails=False))
    assert published == ["GenerationJob"] and stored.request_id == rid


def test_a_request_record_that_cannot_be_stored_holds_its_request_at_most_record_retry_s(deployment, caplog):
    """A record JetStream does not take (here its stream is gone: no responders, retried like an
    election) is published again for ``RECORD_RETRY_S`` - the request waits for it - not for the
    publisher's retry window; then its loss is logged and the request goes on."""
    url, subjects = deployment

    async def main() -> tuple[float, str, str, list[str]]:
        nc = await nats.connect(url)
        try:
            await nc.jetstream().delete_stream(subjects.stream_requests)
            client = await _client(nc, subjects)
            client.publisher = publisher = _RecordPublisher(nc.jetstream(), send_fails=True)
            publisher.retry_s = 30.0  # (a worker's window is 10 s; the API's, the request's deadline)
            rid = f"chatcmpl-{uuid.uuid4().hex}"
            record = ChatRequestRecord(request_id=rid, received_at=time.time(), model="m", body={})
            started = time.monotonic()
            stream = await client.submit(_job(rid, time.time() + 60), record=record)
            took = time.monotonic() - started
            await stream.cancel(EPDError("done"))
            return took, (await _worker_takes_job(nc, subjects)).request_id, rid, publisher.published
        finally:
            await nc.close()

    took, job_of, rid, published = asyncio.run(main())
    assert job_of == rid and published == ["GenerationJob", "ChatRequestRecord"]
    assert "could not record request" in caplog.text
    assert took < RequestClient.RECORD_RETRY_S + 2.0, took
