"""The request client: the one implementation of the request protocol, for the API and for replay.

A request, as :meth:`RequestClient.submit` sends it from a :class:`Submission` (the API for every
chat request, ``epd replay run`` for a re-run; nothing else publishes these):

0. each distinct image stored once, content-addressed (an image the API loaded; a replay's are
   stored already), and checked against the store of the client's encoder fingerprint: a stored
   EC object means no encode job (``ImageRef.encode_queued = False``, the use recorded, counted in
   ``epd:ec_lookups_total``); so does ``encode=False`` (the agg topology; a replay without an
   encoder);
1. one :class:`~shared.protocol.EncodeJob` per distinct image whose EC object is not stored yet,
   with ``Nats-Msg-Id = <EC key>@<generation of its index entry>``
   (:func:`~shared.protocol.encode_job_msg_id`) so that concurrent duplicates (another request
   with the same image, a replay) collapse into one job, while asking again for an object that was
   evicted or purged meanwhile queues a new one (:meth:`RequestClient.queue_encode`);
2. the :class:`~shared.protocol.ChatRequestRecord` on ``<p>.requests.<id>``, for replay and the
   debug page, with ``Nats-Msg-Id = <request id>-record`` (best effort: its loss does not fail the
   request; a record published again is stored once);
3. a subscription to ``<p>.tokens.<id>``, made BEFORE the job is published (core NATS keeps no
   history: a fast worker's first tokens would be lost);
4. the :class:`~shared.protocol.GenerationJob` with ``Nats-Msg-Id = <request id>``;
5. a :class:`TokenStream` of what the workers publish on the tokens subject.

The token stream's one dedup rule: a ``TokenChunk`` is new iff its ``seq`` is at or past the end of
what was already forwarded, so the first copy of each seq wins, whatever its ``attempt`` (a
redelivered job restarts at seq 0 and repeats the tokens it already streamed: the seed is derived
from the request id, ``protocol.effective_seed``). The first ``FinalResult`` or ``ErrorEvent``
ends it; so does the job's deadline (``DeadlineExceeded``). A ``FinalResult`` that carries the
request's last chunk (``FinalResult.last_chunk``) is that chunk and then the result. Never a gap
in the text: a chunk past one, or a ``FinalResult`` with more tokens than were forwarded, is held
back until the missed chunks arrive - read from the stream store at once and then again, more
slowly, while the gap lasts (a chunk heard on the subscription may not be stored yet: its stream
was electing a leader, and the worker publishes it again; ``shared.token_stream``), or repeated
by a redelivered job - or the deadline passes. Without a stream store a gap fails the request. A
caller that gives up cancels the request (:meth:`RequestClient.abandon`: the workers stop
working on it, ``shared.cancellation``).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
from nats.aio.client import Client as NATS
from nats.js.errors import NotFoundError

from shared import metrics, protocol
from shared.cancellation import cancel_record
from shared.ec_lifecycle.index import ECIndex, entry_key
from shared.ec_lifecycle.uses import UseRecorder
from shared.errors import DeadlineExceeded, EPDError, PayloadTooLarge, WorkerFailed
from shared.jetstream import (
    JetStreamPublisher,
    PendingAck,
    Publisher,
    TypedSubscription,
    nats_unavailable,
    subscribe_typed,
    through_elections,
)
from shared.media import LoadedImage
from shared.protocol import (
    ChatRequestRecord,
    ECWanted,
    EncodeJob,
    ErrorEvent,
    FinalResult,
    GenerationJob,
    ImageRef,
    MediaKind,
    SamplingSpec,
    Subjects,
    TokenChunk,
    generation_schema,
)
from shared.routing import JobRouter
from shared.store.ec import ECStore
from shared.store.format import RawTensor, VideoSource, encode_video_frames
from shared.video import SampledVideo

log = logging.getLogger(__name__)

TokenEvent = TokenChunk | FinalResult | ErrorEvent
Terminal = FinalResult | ErrorEvent
#: Reads a request's events stored after a stream sequence: ``(events, last sequence read)``.
StoredEvents = Callable[[int], Awaitable[tuple[list[TokenEvent], int]]]
#: At most this many stored events are read in one catch-up (a request's chunks and attempts).
MAX_STORED_EVENTS = 65536


class TokenStream:
    """The events of one request: ``TokenChunk`` s (deduplicated, see the module docstring), then
    one ``FinalResult`` or ``ErrorEvent``, as an async iterator.

    At the deadline it awaits ``on_abandon(error)`` (the API: :meth:`RequestClient.abandon`, which
    records the end and cancels the request's work) and raises :class:`DeadlineExceeded`. A caller
    that gives up earlier (its client disconnected, it failed) calls :meth:`cancel`. It
    unsubscribes when it ends; call :meth:`aclose` when leaving it earlier (closing twice is
    harmless)."""

    #: Seconds without an event after which the stream reads what it missed from the stream store.
    CATCH_UP_IDLE_S = 3.0

    def __init__(
        self,
        sub: TypedSubscription,
        *,
        request_id: str,
        deadline: float,
        on_abandon: Callable[[EPDError], Awaitable[None]] | None = None,
        stored: StoredEvents | None = None,
        on_final: Callable[[FinalResult], None] | None = None,
    ):
        self._sub = sub
        self.request_id = request_id
        self.deadline = deadline
        self.on_abandon = on_abandon
        #: Reads the request's events from ``<P>_RESULTS`` (None: the core subscription only).
        #: The subscription is core NATS: whatever is published while this process's connection
        #: moves to another NATS server (its server died, stalled or was cut off) never reaches
        #: it. The stream has every event, so the token stream reads what it missed there - when
        #: a chunk arrives past a gap, and after ``CATCH_UP_IDLE_S`` without any event (a lost
        #: final result leaves no later message to show the gap).
        self._stored = stored
        self._stored_seq = 0  # the last stream sequence read from the store
        self._pending: collections.deque[TokenEvent] = collections.deque()
        #: Events past a gap (tokens before them not forwarded yet), held until it is filled.
        self._held: list[TokenEvent] = []
        #: While events are held: when the store is read next, and the pause after that read.
        self._catch_up_at = 0.0
        self._catch_up_pause = 0.0
        #: told of the request's ``FinalResult`` (the router learns where its images are now)
        self.on_final = on_final
        #: The request is over: a terminal event arrived, the deadline passed, or it was cancelled.
        self.ended = False
        #: tokens forwarded so far (the seq the next new chunk starts at)
        self.forwarded = 0
        #: chunks dropped as copies of what was already forwarded (a redelivered job's)
        self.duplicates = 0
        self._done = False

    def __aiter__(self) -> TokenStream:
        return self

    async def __anext__(self) -> TokenEvent:
        if self._done:
            raise StopAsyncIteration
        while True:
            event: TokenEvent
            if self._pending:
                event = self._pending.popleft()
            elif self._held and time.time() >= self._catch_up_at:
                # A gap: read the store now, then again more slowly while it lasts (the worker
                # publishes a chunk JetStream did not store again, after its stream's election).
                await self._catch_up()
                self._catch_up_pause = min(max(2 * self._catch_up_pause, 0.2), self.CATCH_UP_IDLE_S)
                self._catch_up_at = time.time() + self._catch_up_pause
                continue
            else:
                if self._stored is None:
                    wait = self.deadline
                else:
                    wait = min(self.deadline, self._catch_up_at if self._held else time.time() + self.CATCH_UP_IDLE_S)
                received: TokenEvent | None = await self._sub.next(deadline=wait)
                if received is None:
                    if time.time() < self.deadline:
                        if not self._held:  # quiet for CATCH_UP_IDLE_S: anything missed?
                            await self._catch_up()
                        continue
                    error = DeadlineExceeded(f"the request passed its deadline before the model finished{self._gap()}")
                    await self.cancel(error)
                    raise error
                event = received
            last_missing = self._last_missing(event)
            if last_missing is not None:
                if self._stored is None or len(self._held) >= MAX_STORED_EVENTS:
                    # never a gap in the text: no store to read the missed chunks from (or a
                    # stream that far past one)
                    lost = WorkerFailed(
                        f"token stream of {self.request_id} lost chunks {self.forwarded}..{last_missing}"
                    )
                    await self.cancel(lost)
                    raise lost
                if not self._held:
                    self._catch_up_at, self._catch_up_pause = 0.0, 0.0  # (read the store at once)
                self._held.append(event)
                continue
            if isinstance(event, FinalResult) and event.last_chunk is not None:
                # the request's last chunk came with its result: the chunk, then the result
                self._pending.appendleft(event.split()[1])
                event = event.last_chunk
            if isinstance(event, TokenChunk):
                if event.seq < self.forwarded:
                    self.duplicates += 1
                    continue
                self.forwarded = event.seq + len(event.token_ids)
                if self._held:  # the held events that follow on now go next, in token order
                    follow = [e for e in self._held if self._needs(e) <= self.forwarded]
                    if follow:
                        self._held = [e for e in self._held if self._needs(e) > self.forwarded]
                        self._pending.extendleft(reversed(sorted(follow, key=self._needs)))
                return event
            self.ended = True
            await self.aclose()  # FinalResult or ErrorEvent: the end
            if self.on_final is not None and isinstance(event, FinalResult):
                self.on_final(event)
            return event

    @staticmethod
    def _needs(event: TokenEvent) -> int:
        """How many tokens must be forwarded before ``event``: a chunk's ``seq``, a result's
        token count (every token of a request is streamed as a chunk) or, when it carries the
        last chunk, that chunk's ``seq``; none for an error."""
        if isinstance(event, TokenChunk):
            return event.seq
        if isinstance(event, FinalResult):
            return event.last_chunk.seq if event.last_chunk is not None else len(event.token_ids)
        return 0

    def _last_missing(self, event: TokenEvent) -> int | None:
        """The last token missing before ``event`` when chunks before it did not arrive, else None."""
        needs = self._needs(event)
        return needs - 1 if needs > self.forwarded else None

    def _gap(self) -> str:
        """What the held events wait for, for an error message ("" when none are held)."""
        if not self._held:
            return ""
        missing = min(map(self._needs, self._held)) - 1
        return f" (waiting for tokens {self.forwarded}..{missing}: not heard, not in the stream store)"

    @property
    def ready(self) -> bool:
        """The next event can be read without waiting for NATS (one is queued, or the stream is over)."""
        return self._done or bool(self._pending) or self._sub.ready

    async def _catch_up(self) -> None:
        """Queue the request's events stored since the last read (in stream order; the usual
        dedup drops what already arrived). Nothing when NATS did not answer (read again later)."""
        assert self._stored is not None
        try:
            events, self._stored_seq = await self._stored(self._stored_seq)
        except Exception as exc:  # noqa: BLE001 - nats raises several unrelated types; read again later
            log.debug("reading the stored events of %s: %s: %s", self.request_id, type(exc).__name__, exc)
            return
        if events:
            log.info(
                "read %d event(s) of %s from the stream store (missed on the subscription?)",
                len(events),
                self.request_id,
            )
        self._pending.extend(events)

    async def cancel(self, error: EPDError) -> None:
        """Give up on the request: stop reading and, unless it already ended, ``on_abandon(error)``."""
        await self.aclose()
        if not self.ended:
            self.ended = True
            if self.on_abandon is not None:
                await self.on_abandon(error)

    async def aclose(self) -> None:
        self._done = True
        await self._sub.close()

    async def collect(self) -> tuple[list[TokenChunk], Terminal]:
        """Every forwarded chunk and the terminal event (raises DeadlineExceeded at the deadline)."""
        chunks: list[TokenChunk] = []
        try:
            async for event in self:
                if isinstance(event, TokenChunk):
                    chunks.append(event)
                else:
                    return chunks, event
        finally:
            await self.aclose()
        raise RuntimeError(f"the token stream of {self.request_id} was closed before its end")


def chunk_texts(chunks: list[TokenChunk]) -> list[str]:
    """One text per token of ``chunks`` (a chunk's text goes with its first token)."""
    return [chunk.text if i == 0 else "" for chunk in chunks for i in range(len(chunk.token_ids))]


_END = object()


class ChoiceStreams:
    """The token streams of a request's choices, merged: an async iterator of ``(choice index,
    event)`` in arrival order (each choice's own events in their order), until every choice has
    ended (its ``FinalResult`` or ``ErrorEvent``). A :class:`DeadlineExceeded` (or any other
    failure) of one stream is raised here. ``ended``, :meth:`cancel` and :meth:`aclose` act on
    every choice."""

    def __init__(self, streams: Sequence[TokenStream]):
        self.streams = list(streams)
        self._queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self._pumps: list[asyncio.Task] = []
        self._open = len(self.streams)

    def __len__(self) -> int:
        return len(self.streams)

    @property
    def ended(self) -> bool:
        return all(s.ended for s in self.streams)

    @property
    def ready(self) -> bool:
        """The next event can be read without waiting for NATS (see :attr:`TokenStream.ready`)."""
        if len(self.streams) == 1:
            return self.streams[0].ready
        return not self._queue.empty()

    async def _pump(self, index: int, stream: TokenStream) -> None:
        try:
            async for event in stream:
                await self._queue.put((index, event))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the reader, which raises it
            await self._queue.put((index, exc))
        await self._queue.put((index, _END))

    def __aiter__(self) -> ChoiceStreams:
        return self

    async def __anext__(self) -> tuple[int, TokenEvent]:
        if len(self.streams) == 1:  # nothing to merge: no pump task and queue in between
            return 0, await anext(self.streams[0])
        if not self._pumps:
            self._pumps = [asyncio.ensure_future(self._pump(i, s)) for i, s in enumerate(self.streams)]
        while self._open:
            index, item = await self._queue.get()
            if item is _END:
                self._open -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            return index, item
        raise StopAsyncIteration

    async def cancel(self, error: EPDError) -> None:
        """Give up on every choice that has not ended (:meth:`TokenStream.cancel`)."""
        self._stop_pumps()
        for stream in self.streams:
            await stream.cancel(error)

    async def aclose(self) -> None:
        self._stop_pumps()
        for stream in self.streams:
            await stream.aclose()

    def _stop_pumps(self) -> None:
        for task in self._pumps:
            if not task.done():
                task.cancel()


def item_hash_of(item: LoadedImage | SampledVideo | ImageRef) -> str:
    """The content hash of a request's media item (the item part of its EC key)."""
    return item.content_hash if isinstance(item, LoadedImage) else item.item_hash


@dataclass(frozen=True)
class Submission:
    """A request to submit (:meth:`RequestClient.submit`): what its ``GenerationJob`` and its
    ``ChatRequestRecord`` carry, and its images in prompt order (one per placeholder)."""

    request_id: str
    model: str
    #: the chat messages in wire form (``ChatMessage.to_wire``)
    messages: list[dict[str, Any]]
    sampling: SamplingSpec
    stream: bool
    received_at: float
    #: when the request ends with ``DeadlineExceeded`` at the latest (epoch seconds)
    deadline: float
    #: the recorded request body (images redacted to references)
    body: dict[str, Any] = field(default_factory=dict)
    #: loaded images (the API: their bytes are stored here) or references to stored ones (replay)
    images: Sequence[LoadedImage | SampledVideo | ImageRef] = ()
    #: ``epd replay run``: the request this one re-runs
    replay_of: str = ""
    #: the encoder fingerprint the job is for (default: the client's store's)
    fingerprint: str = ""
    #: ``/v1/completions``: the prompt (text or token ids; ``messages`` and ``images`` empty)
    prompt: str | tuple[int, ...] | None = None
    #: a chat request's tools for the chat template (``GenerationJob.tools``)
    tools: tuple[str, ...] = ()


class RequestClient:
    """Submits requests to the workers over JetStream and reads their token streams.

    ``store``: the EC store of the encoder fingerprint requests are submitted for (their images'
    bytes go there, its EC objects spare encode jobs; without one no encode job is queued);
    ``recorder``: notes the uses of stored EC objects (the EC lifecycle); ``source``: the
    ``epd:ec_lookups_total`` label of the store checks."""

    #: One try of a JetStream read on the submission path (it takes milliseconds when a leader
    #: answers; a stalled server must not hold a try for the client's 5 s default).
    READ_TIMEOUT_S = 2.0
    #: How long a request record whose first send was not acknowledged is published again (it is
    #: best effort, and the request waits for it: not the job's retry window).
    RECORD_RETRY_S = 2.0

    def __init__(
        self,
        nc: NATS,
        subjects: Subjects,
        publisher: Publisher | None = None,
        *,
        ec_index: ECIndex,
        store: ECStore | None = None,
        recorder: UseRecorder | None = None,
        source: str = "api",
        retry_s: float = 10.0,
        router: JobRouter | None = None,
        on_final: Callable[[FinalResult], None] | None = None,
    ):
        self.nc = nc
        self.subjects = subjects
        self.publisher = publisher if publisher is not None else JetStreamPublisher(nc.jetstream())
        #: the EC index, whose entry revisions tell one lifetime of an EC object from the next
        self.ec_index = ec_index
        self.store = store
        self.recorder = recorder
        self.source = source
        #: how long a JetStream read of the submission path is retried through a leader election
        #: (``EPD_PUBLISH_RETRY_S``; also bounded by the request's deadline)
        self.retry_s = retry_s
        #: ``EPD_ROUTING=affinity``: publishes each generation job where it routes it (``shared.routing``)
        self.router = router
        #: told every final result of the requests it submits (the API's job costs, and the router)
        self.on_final = on_final

    async def image_refs(
        self,
        request_id: str,
        images: Sequence[LoadedImage | SampledVideo | ImageRef],
        *,
        encode: bool = True,
        deadline: float | None = None,
    ) -> list[ImageRef]:
        """Step 0 and 1 of the module docstring: each distinct image stored and, with ``encode``,
        its encode job queued unless its EC object is stored. Returns one ref per image, in order.
        ``deadline``: the request's (NATS elections are waited out until then; see :meth:`queue_encode`)."""
        refs: list[ImageRef] = []
        distinct: dict[str, ImageRef] = {}
        for img in images:
            item = item_hash_of(img)
            if item not in distinct:
                distinct[item] = await self._image_ref(request_id, img, encode=encode, deadline=deadline)
            refs.append(distinct[item])
        return refs

    async def _image_ref(
        self, request_id: str, img: LoadedImage | SampledVideo | ImageRef, *, encode: bool, deadline: float | None
    ) -> ImageRef:
        if isinstance(img, LoadedImage):
            if self.store is None:
                raise RuntimeError("RequestClient: a loaded image needs a store to put its bytes in")
            media_key = await asyncio.to_thread(self.store.put_media, img.content_hash, img.data)
            ref = ImageRef(item_hash=img.content_hash, media_key=media_key, width=img.width, height=img.height)
        elif isinstance(img, SampledVideo) and img.segments:
            # a video in segments: each segment its own item (stored, encoded once fleet-wide); the
            # video is their features joined, at the video's rate
            segments = [
                await self._image_ref(request_id, seg, encode=encode, deadline=deadline) for seg in img.segments
            ]
            n, height, width, _ = img.frames.shape
            return ImageRef(
                item_hash=img.item_hash,
                media_key="",
                width=width,
                height=height,
                kind=MediaKind.VIDEO,
                frames=n,
                fps=img.sampled_fps,
                segments=tuple(segments),
                encode_queued=any(seg.encode_queued for seg in segments),
                source_indices=tuple(img.indices),
                source_fps=float(img.info.fps),
                source_frames=img.info.total_frames,
            )
        elif isinstance(img, SampledVideo):
            if self.store is None:
                raise RuntimeError("RequestClient: a loaded video needs a store to put its frames in")
            media_key = await asyncio.to_thread(self._put_video, img)
            n, height, width, _ = img.frames.shape
            ref = ImageRef(
                item_hash=img.item_hash,
                media_key=media_key,
                width=width,
                height=height,
                kind=MediaKind.VIDEO,
                frames=n,
                fps=img.sampled_fps,
            )
        else:
            ref = img
        if not encode or self.store is None:  # agg: its worker encodes in process; replay without an encoder
            return msgspec.structs.replace(ref, encode_queued=False)
        info = await asyncio.to_thread(self.store.stored, ref.item_hash)
        if info is not None:
            log.info("item %s already encoded for this fingerprint: no encode job", ref.item_hash[:12])
            if self.recorder is not None:
                self.recorder.note(info.key, self.store.fingerprint, ref.item_hash, size=info.size)
            # the EC store's hit ratio over time: rate(hit) / rate(hit + miss) of source "api"
            metrics.EC_LOOKUPS.labels(self.source, metrics.LookupOutcome.HIT, "").inc()
            return msgspec.structs.replace(ref, encode_queued=False)
        metrics.EC_LOOKUPS.labels(self.source, metrics.LookupOutcome.MISS, "not_found").inc()
        ref = msgspec.structs.replace(ref, encode_queued=True)
        await self.queue_encode(
            EncodeJob(
                request_id=request_id,
                image=ref,
                fingerprint=self.store.fingerprint,
                ec_key=self.store.key(ref.item_hash),
                created_at=time.time(),
            ),
            deadline=deadline,
        )
        return ref

    def _put_video(self, video: SampledVideo) -> str:
        """Store a video's sampled frames (content-addressed; what the workers read)."""
        assert self.store is not None
        frames = RawTensor(video.frames.tobytes(), "U8", tuple(video.frames.shape))
        # (which frames of the source they are: Qwen3-VL writes their times into the prompt)
        source = VideoSource(
            indices=tuple(video.indices), fps=float(video.info.fps), total_frames=video.info.total_frames
        )
        blob = encode_video_frames(
            frames,
            item_hash=video.item_hash,
            sampled_fps=video.sampled_fps,
            producer=self.store.producer,
            source=source,
        )
        return self.store.put_media(video.item_hash, blob)

    async def queue_encode(self, job: EncodeJob, *, deadline: float | None = None) -> bool:
        """Publish an encode job (``Nats-Msg-Id``: :func:`~shared.protocol.encode_job_msg_id` of its
        EC key and the generation of its index entry). False: a job for the same EC object in the
        same generation is already queued within the duplicate window (JetStream dropped this one);
        this request then says it wants that job (``ECWanted``), so cancelling the request that
        queued it does not drop it (``shared.cancellation``).

        Both the index read and the publish are waited out through a NATS leader election or a
        reconnect until ``deadline`` (the request's; None: ``retry_s`` from now)."""
        key = entry_key(job.fingerprint, job.image.item_hash)
        until = deadline if deadline is not None else time.time() + self.retry_s
        try:
            generation = await through_elections(
                lambda left: asyncio.wait_for(self.ec_index.generation(key), left),
                doing="reading the EC index",
                until=until,
                timeout=self.READ_TIMEOUT_S,
            )
        except EPDError:
            raise
        except Exception as exc:  # nats-py raises several unrelated types
            raise nats_unavailable("reading the EC index", exc) from exc
        fresh = await self.publisher.publish(
            self.subjects.encode_jobs,
            job,
            request_id=job.request_id,
            msg_id=protocol.encode_job_msg_id(job.ec_key, generation),
            deadline=until,
        )
        log.info(
            "encode job for %s (generation %d) %s",
            job.image.item_hash[:12],
            generation,
            "queued" if fresh else "already queued (deduplicated)",
        )
        if not fresh:
            wanted = ECWanted(
                request_id=job.request_id,
                fingerprint=job.fingerprint,
                item_hash=job.image.item_hash,
                created_at=time.time(),
            )
            try:
                await self.publisher.publish(
                    self.subjects.ec_wanted(job.fingerprint, job.image.item_hash), wanted, request_id=job.request_id
                )
            except EPDError as exc:
                # Best effort: without it, cancelling the other request may drop the job (this
                # request's worker then encodes the image itself).
                log.warning("could not record interest in the encode job: %s", exc.message)
        return fresh

    async def submit(
        self,
        request: Submission | GenerationJob,
        *,
        record: ChatRequestRecord | None = None,
        encode: bool = True,
        on_abandon: Callable[[EPDError], Awaitable[None]] | None = None,
    ) -> TokenStream:
        """Submit a request: the whole protocol of the module docstring for a :class:`Submission`
        (its images stored and encode jobs queued - ``encode=False``: none - within its deadline,
        else ``DeadlineExceeded``; its record; its generation job), or steps 2-5 for a
        ``GenerationJob`` built already (``record`` then is its record, if any).

        Returns the token stream, bounded by the deadline (``on_abandon``: see :class:`TokenStream`).
        Raises PayloadTooLarge when the job does not fit in one NATS message."""
        if isinstance(request, Submission):
            job, record = await self._prepare(request, encode=encode)
        else:
            job = request
        return await self._publish(job, record=record, on_abandon=on_abandon)

    async def _prepare(self, sub: Submission, *, encode: bool) -> tuple[GenerationJob, ChatRequestRecord]:
        try:
            async with asyncio.timeout(max(0.0, sub.deadline - time.time())):
                images = tuple(await self.image_refs(sub.request_id, sub.images, encode=encode, deadline=sub.deadline))
        except TimeoutError:
            raise DeadlineExceeded("the request passed its deadline while loading images") from None
        record = ChatRequestRecord(
            request_id=sub.request_id,
            received_at=sub.received_at,
            model=sub.model,
            body=sub.body,
            images=images,
            replay_of=sub.replay_of,
        )
        job = GenerationJob(
            v=generation_schema(sub.messages),
            request_id=sub.request_id,
            model=sub.model,
            messages=sub.messages,
            images=images,
            fingerprint=sub.fingerprint or (self.store.fingerprint if self.store is not None else ""),
            sampling=sub.sampling,
            stream=sub.stream,
            deadline=sub.deadline,
            created_at=time.time(),
            prompt=sub.prompt,
            tools=sub.tools,
        )
        return job, record

    async def submit_choices(
        self,
        request: Submission,
        choices: Sequence[tuple[str, SamplingSpec]],
        *,
        encode: bool = True,
        on_abandon: Callable[[str, EPDError], Awaitable[None]] | None = None,
    ) -> ChoiceStreams:
        """Submit the ``n`` choices of one request: one generation job per ``(request id,
        sampling)`` of ``choices`` - each with its own record and token stream - over the same
        images, stored and queued for encoding ONCE (the first choice's id is on the encode
        jobs). ``on_abandon(request_id, error)``: see :class:`TokenStream`.

        Returns the streams merged (:class:`ChoiceStreams`); when publishing one fails, the
        choices already published are cancelled."""
        if not choices:
            raise ValueError("submit_choices: no choice")
        job, record = await self._prepare(request, encode=encode)
        streams: list[TokenStream] = []
        try:
            for request_id, sampling in choices:
                streams.append(
                    await self._publish(
                        msgspec.structs.replace(job, request_id=request_id, sampling=sampling),
                        record=msgspec.structs.replace(record, request_id=request_id),
                        on_abandon=functools.partial(on_abandon, request_id) if on_abandon is not None else None,
                    )
                )
        except BaseException as exc:
            error = exc if isinstance(exc, EPDError) else EPDError(f"submitting the choices failed: {exc!r}")
            for stream in streams:
                await stream.cancel(error)
            raise
        return ChoiceStreams(streams)

    async def _publish(
        self,
        job: GenerationJob,
        *,
        record: ChatRequestRecord | None,
        on_abandon: Callable[[EPDError], Awaitable[None]] | None,
    ) -> TokenStream:
        request_id = job.request_id
        payload_limit = self.nc.max_payload
        if len(protocol.encode(job)) > payload_limit:
            raise PayloadTooLarge(f"the prompt is too large (over {payload_limit} bytes encoded)")
        # The record (for replay and the debug pages) goes out first without waiting; its
        # acknowledgement is awaited after the job's publish.
        recording = await self._send_record(record) if record is not None else None
        sub = await subscribe_typed(self.nc, self.subjects.tokens(request_id), TokenChunk, FinalResult, ErrorEvent)
        try:
            # retried through a NATS leader election until the request's deadline (deduplicated)
            if self.router is not None:
                await self.router.publish(job)
            else:
                await self.publisher.publish(
                    self.subjects.generate_jobs, job, request_id=request_id, msg_id=request_id, deadline=job.deadline
                )
        except BaseException:
            await sub.close()
            raise
        finally:
            if record is not None:
                await self._confirm_record(record, recording)
        return TokenStream(
            sub,
            request_id=request_id,
            deadline=job.deadline,
            on_abandon=on_abandon,
            stored=functools.partial(self.stored_events, request_id),
            on_final=self._final,
        )

    def _final(self, final: FinalResult) -> None:
        if self.router is not None:
            self.router.observe(final)
        if self.on_final is not None:
            self.on_final(final)

    async def _send_record(self, record: ChatRequestRecord) -> PendingAck | None:
        try:
            return await self.publisher.send(
                self.subjects.request(record.request_id),
                record,
                request_id=record.request_id,
                msg_id=protocol.request_record_msg_id(record.request_id),
            )
        except EPDError:
            return None  # (published again, through elections, by _confirm_record)

    async def _confirm_record(self, record: ChatRequestRecord, recording: PendingAck | None) -> None:
        """Wait for the record's acknowledgement; when it was not stored, publish it again,
        retried through leader elections like a job, for ``RECORD_RETRY_S``. Its loss is logged,
        never the request's failure: the record is for debugging."""
        try:
            if recording is not None:
                try:
                    await recording.confirmed()
                    return
                except EPDError:
                    pass
            await self.publisher.publish(
                self.subjects.request(record.request_id),
                record,
                request_id=record.request_id,
                msg_id=protocol.request_record_msg_id(record.request_id),
                deadline=time.time() + self.RECORD_RETRY_S,
            )
        except Exception as exc:  # noqa: BLE001 - the record is for debugging; its loss must not fail the request
            log.warning("could not record request: %s", exc)

    async def stored_events(self, request_id: str, after_seq: int) -> tuple[list[TokenEvent], int]:
        """The request's token events in ``<P>_RESULTS`` after stream sequence ``after_seq``, in
        stream order (at most ``MAX_STORED_EVENTS``), and the last sequence read (``after_seq``
        when there are none): one JetStream read per event, by subject."""
        # (each read bounded like the other reads: one sent into a stalled server must not hold
        # the catch-up for the context's 5 s)
        js = self.nc.jetstream(timeout=self.READ_TIMEOUT_S)
        subject = self.subjects.tokens(request_id)
        events: list[TokenEvent] = []
        seq = after_seq
        for _ in range(MAX_STORED_EVENTS):
            try:
                raw = await js.get_msg(self.subjects.stream_results, seq=seq + 1, subject=subject, next=True)
            except NotFoundError:
                break
            seq = raw.seq or seq + 1
            try:
                event = protocol.decode(raw.data or b"", (TokenChunk, FinalResult, ErrorEvent))
            except protocol.ProtocolError as exc:
                log.warning("skipping a stored message on %s: %s", subject, exc)
                continue
            if isinstance(event, TokenChunk | FinalResult | ErrorEvent):  # (what decode checked)
                events.append(event)
        return events, seq

    async def record_refused(
        self, record: ChatRequestRecord, error: EPDError, *, stage: str = "api", timeout_s: float = 2.0
    ) -> None:
        """Record a request refused before any job was published (bad input, an image URL that
        failed): its ``record`` and an ``ErrorEvent`` of ``error`` on its token subject, so the
        results stream - ``epd replay list --status error``, the debug pages - show how it ended.
        Best effort and bounded by ``timeout_s``: the caller reports the error either way."""
        request_id = record.request_id
        try:
            async with asyncio.timeout(timeout_s):
                await self.publisher.publish(self.subjects.request(request_id), record, request_id=request_id)
                event = protocol.error_event(request_id, stage, error)
                await self.publisher.publish(self.subjects.tokens(request_id), event, request_id=request_id)
        except Exception as exc:  # noqa: BLE001 - best effort: the request is refused either way
            log.warning("could not record the refused request: %s: %s", type(exc).__name__, exc)

    async def abandon(self, request_id: str, error: EPDError, *, stage: str = "api") -> None:
        """The caller gave up on the request (``error``: deadline, client gone, API failure):

        * cancel it: a :class:`~shared.protocol.RequestCancelled` on ``<p>.control.cancel.<id>``,
          so workers drop its queued jobs and stop its running ones (``shared.cancellation``);
        * say so on its token subject, so the results stream - and ``epd replay`` - show how it
          ended, not "incomplete".

        Best effort (the caller reports the error either way); counted in
        ``epd:requests_cancelled_total{stage="api"}``."""
        metrics.REQUESTS_CANCELLED.labels(stage).inc()
        log.info("abandoning the request: %s: %s", error.code, error.message)
        try:
            await self.publisher.publish(
                self.subjects.cancel(request_id),
                cancel_record(request_id, error.code),
                request_id=request_id,
                msg_id=f"cancel-{request_id}",
            )
        except Exception as exc:  # noqa: BLE001 - best effort: the request is already failed
            log.warning("could not cancel the request's work: %s", exc)
        event = protocol.error_event(request_id, stage, error)
        try:
            await self.publisher.publish(self.subjects.tokens(request_id), event, request_id=request_id)
        except Exception as exc:  # noqa: BLE001 - best effort: the request is already failed
            log.warning("could not record the abandoned request: %s", exc)
