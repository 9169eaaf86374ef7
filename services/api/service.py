"""The API process's composition: connections, the model identity, the EC store and its
lifecycle, the request client, the worker view, the delivery supervisor, start and stop.

``services.api.app`` maps HTTP onto it; nothing here knows about HTTP. The delivery supervisor
(``services.api.supervisor``) runs in a queue group, so one API replica fails each job that
exhausted its deliveries.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import nats

from services.api.routing import Router, RouterTuning
from services.api.scaling import ScalingSignal
from services.api.schemas import MediaURL, ParsedRequest, redact_images
from services.api.supervisor import DeliverySupervisor
from shared import protocol
from shared.client import ChoiceStreams, RequestClient, Submission, item_hash_of
from shared.config import ApiSettings, RoutingMode
from shared.decode_budget import DecodeBudget
from shared.ec_lifecycle.claims import EncodeClaims
from shared.ec_lifecycle.process import ECLifecycle, start_api_lifecycle
from shared.errors import EPDError, ServiceUnavailable
from shared.families import (
    VIDEO_SEGMENT_FAMILIES,
    check_video,
    max_aspect_ratio,
    model_type_of,
    video_processor_of,
    video_temporal_patch,
)
from shared.fetch import ImageFetcher, load_image, load_video_url
from shared.identity import ModelIdentity
from shared.jetstream import JetStreamPublisher, close_connection, connect, ensure_topology
from shared.media import LoadedImage, MediaLimits
from shared.protocol import ChatRequestRecord, ImageRef, MediaKind, SamplingSpec, Subjects, WorkerHeartbeat
from shared.routed_jobs import RoutingClaims
from shared.store.ec import ECStore
from shared.store.factory import open_stores
from shared.topology import TOPOLOGIES
from shared.video import (
    SampledVideo,
    VideoLimits,
    VideoSampler,
    VideoSampling,
    check_sampling,
    sampler_of_processor,
    split_segments,
)

log = logging.getLogger(__name__)


@dataclass
class WorkerView:
    """Live workers seen through their heartbeats (``/health``): a beat within ``stale_s``, and
    not draining (a stopping worker takes no new work: it leaves the count at its first
    "draining" beat, not ``stale_s`` after its last one)."""

    stale_s: float
    seen: dict[tuple[str, str], WorkerHeartbeat] = field(default_factory=dict)

    def update(self, hb: WorkerHeartbeat) -> None:
        self.seen[(hb.role, hb.worker_id)] = hb

    def live(self) -> dict[str, list[WorkerHeartbeat]]:
        now = time.time()
        out: dict[str, list[WorkerHeartbeat]] = {}
        for (role, _), hb in list(self.seen.items()):
            if now - hb.sent_at <= self.stale_s and not hb.draining:
                out.setdefault(role, []).append(hb)
        return out


def choice_ids(request_id: str, n: int) -> list[str]:
    """The generation job ids of a request's ``n`` choices: the request's own id for the first,
    ``<id>-<i>`` for choice i > 0 (each has its own record, token stream and debug page)."""
    return [request_id] + [f"{request_id}-{i}" for i in range(1, n)]


def choice_sampling(sampling: SamplingSpec, index: int) -> SamplingSpec:
    """Choice ``index``'s sampling: a client seed s becomes s + index (as vLLM seeds the children of
    an ``n`` > 1 request), so choices differ and each is reproducible; without one each choice's
    worker derives its seed from the choice's own id (``protocol.effective_seed``)."""
    if index == 0 or sampling.seed is None:
        return sampling
    return msgspec.structs.replace(sampling, seed=(sampling.seed + index) % 2**63)


class StopSignal:
    """Set once, when the API starts stopping. Besides ``is_set()``, a waiting request registers a
    callback (:meth:`listen`) instead of a task awaiting an event: one fewer task per request.
    Used on the event loop only (``begin_shutdown`` gets there with ``call_soon_threadsafe``)."""

    def __init__(self) -> None:
        self._set = False
        self._listeners: list[Callable[[], None]] = []

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        if self._set:
            return
        self._set = True
        listeners, self._listeners = self._listeners, []
        for listener in listeners:
            listener()

    def listen(self, listener: Callable[[], None]) -> Callable[[], None]:
        """Call ``listener()`` when the signal is set (at once if it is); returns the function that
        stops listening."""
        if self._set:
            listener()
            return lambda: None
        self._listeners.append(listener)

        def stop_listening() -> None:
            try:
                self._listeners.remove(listener)
            except ValueError:  # (already called)
                pass

        return stop_listening


class ApiService:
    """State shared by the request handlers: connections, request client, store, fetcher,
    worker view, delivery supervisor."""

    def __init__(self, settings: ApiSettings):
        self.settings = settings
        self.subjects = Subjects(settings.nats.subject_prefix)
        #: what this API serves and expects its workers to serve (computed once, here)
        self.identity = ModelIdentity.from_settings(settings.model)
        self.model_name = self.identity.model
        self.fingerprint = self.identity.fingerprint
        family = model_type_of(self.identity.model_path)
        self.family = family
        #: how this model's videos are sampled (vLLM's loader for its video processor)
        self.video_sampler = sampler_of_processor(video_processor_of(self.identity.model_path))
        #: frames a video segment holds (0: videos encoded whole): where the family allows segments
        segments_ok = family in VIDEO_SEGMENT_FAMILIES.get(self.identity.engine, ())
        self.video_segment_frames = settings.media.video_segment_frames if segments_ok else 0
        self.video_temporal_patch = video_temporal_patch(self.identity.model_path)
        self.video_limits = VideoLimits(
            max_video_bytes=settings.media.max_video_bytes,
            max_duration_s=settings.media.max_video_duration_s,
            max_total_frames=settings.media.max_video_total_frames,
            max_sampled_frames=settings.media.max_video_frames,
            max_frame_pixels=settings.media.max_video_frame_pixels,
        )
        self.limits = MediaLimits(
            max_image_bytes=settings.media.max_image_bytes,
            max_pixels=settings.media.max_image_pixels,
            fetch_timeout_s=settings.fetch_timeout_s,
            allowed_networks=tuple(settings.url_allow_networks),
            allowed_hosts=tuple(settings.url_allow_hosts),
            # what the family's image processor cannot take is refused here, before a job is queued
            max_aspect_ratio=max_aspect_ratio(family),
            family=family,
        )
        self.workers = WorkerView(settings.worker_stale_s)
        self.nc: nats.NATS | None = None
        self.js: nats.js.JetStreamContext | None = None
        self.client: RequestClient | None = None
        self.supervisor: DeliverySupervisor | None = None
        #: the scaling signal per worker role on ``/metrics`` (``services.api.scaling``)
        self.scaling = ScalingSignal(self.subjects)
        #: ``EPD_ROUTING=affinity``: where generation jobs go (``services.api.routing``)
        self.router: Router | None = None
        self.store: ECStore | None = None
        #: EC store lifecycle: use recording, the index of announced objects, the janitor
        self.ec: ECLifecycle | None = None
        self.fetcher: ImageFetcher | None = None
        self.video_fetcher: ImageFetcher | None = None
        # One for the process: however many requests and images arrive, decoding stays bounded.
        self.decode_budget = DecodeBudget(settings.decode_budget_pixels())
        self._subs: list = []
        self._background: set[asyncio.Task] = set()
        #: Set when the process is stopping: requests still waiting end with 503.
        self.stopping = StopSignal()
        self.loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.nc = await connect(self.settings.nats, name=f"epd-api-{self.settings.worker_id}")
        self.js = self.nc.jetstream()
        await ensure_topology(self.js, self.settings.nats, self.subjects, nc=self.nc)
        # The claims buckets too: the workers' NATS identities bind to them, create nothing
        # (``shared.nats_auth``; the EC index is opened below).
        await EncodeClaims.open(self.js, self.subjects, self.settings.nats)
        await RoutingClaims.open(self.js, self.subjects, self.settings.nats)
        publisher = JetStreamPublisher.for_settings(self.js, self.settings.nats)
        settings = self.settings
        stores = await asyncio.to_thread(
            lambda: open_stores(
                settings.store,
                producer=settings.worker_id,
                ec_fingerprint=self.fingerprint,
                max_media_bytes=settings.media.max_stored_media_bytes,
                ensure_bucket=True,
            )
        )
        self.store = stores.ec_store()
        self.ec = await start_api_lifecycle(
            self.nc,
            self.subjects,
            self.store,
            nats=settings.nats,
            store_settings=settings.store,
            janitor=settings.janitor,
            flush_s=settings.ec_use_flush_s,
            holder=f"api-{settings.worker_id}",
            fingerprint=self.fingerprint,
            model=self.model_name,
            model_path=str(self.identity.model_path),
        )
        if settings.routing is RoutingMode.AFFINITY:
            tuning = router_tuning(settings)
            self.router = Router(self.nc, self.subjects, publisher, settings.nats, tuning, fingerprint=self.fingerprint)
            await self.router.start()
        self.client = RequestClient(
            self.nc,
            self.subjects,
            publisher,
            ec_index=self.ec.index,
            store=self.store,
            recorder=self.ec.recorder,
            retry_s=self.settings.nats.publish_retry_s,
            router=self.router,
            on_final=self.scaling.costs.finished,
        )
        self.fetcher = ImageFetcher(self.limits)
        self.video_fetcher = ImageFetcher(
            dataclasses.replace(self.limits, max_image_bytes=self.settings.media.max_video_bytes), noun="video"
        )
        self._subs.append(await self.nc.subscribe(self.subjects.heartbeat_all, cb=self._on_heartbeat))
        self.supervisor = DeliverySupervisor(
            self.nc, self.subjects, publisher, max_deliver=self.settings.nats.max_deliver
        )
        await self.supervisor.start()
        await self.scaling.start(self.nc)
        log.info(
            "api ready: model %s, encoder fingerprint %s, routing %s",
            self.model_name,
            self.fingerprint,
            settings.routing,
        )

    def begin_shutdown(self, grace_s: float) -> None:
        """The server was asked to stop: requests still running after ``grace_s`` end with 503
        (and are cancelled) instead of being cut off when the server stops waiting for them.
        Safe to call from a signal handler."""
        if self.loop is not None and not self.stopping.is_set():
            self.loop.call_soon_threadsafe(self.loop.call_later, grace_s, self.stopping.set)

    async def stop(self) -> None:
        self.stopping.set()
        if self._background:  # cancellations of abandoned requests: out before the connection drains
            await asyncio.wait(self._background, timeout=5.0)
        if self.supervisor is not None:
            await self.supervisor.stop()
        await self.scaling.stop()
        if self.router is not None:
            await self.router.stop()
        if self.ec is not None:
            await self.ec.close()
        for fetcher in (self.fetcher, self.video_fetcher):
            if fetcher is not None:
                await fetcher.aclose()
        if self.nc is not None:  # drained, or closed at once when the server stalls
            await close_connection(self.nc)

    async def nats_answers(self, timeout_s: float = 2.0) -> bool:
        """Connected and JetStream answers a round trip now (a stalled server keeps the TCP
        connection, so ``is_connected`` alone would say yes)."""
        if self.nc is None or self.js is None or not self.nc.is_connected:
            return False
        try:
            await asyncio.wait_for(self.js.account_info(), timeout_s)
        except Exception as exc:  # noqa: BLE001 - nats raises several unrelated types (timeout, no responders, closed)
            log.warning("NATS does not answer: %s: %s", type(exc).__name__, exc)
            return False
        return True

    async def wait_connected(self, deadline: float) -> None:
        """Return once the NATS client is connected. While it reconnects - its server died or
        stalled and it moves to another seed of the cluster - wait for it, up to
        ``EPD_PUBLISH_RETRY_S`` and the request's ``deadline``: a NATS node failing costs the
        request that long, not a 503. Raises ServiceUnavailable when it is not back by then (or
        the connection is closed for good)."""
        nc = self.nc
        if nc is None or nc.is_closed:
            raise ServiceUnavailable("not connected to NATS")
        if nc.is_connected:
            return
        until = min(deadline, time.time() + self.settings.nats.publish_retry_s)
        while not nc.is_connected:
            if nc.is_closed or time.time() >= until:
                raise ServiceUnavailable("not connected to NATS")
            await asyncio.sleep(0.05)  # nats-py offers no event to await for "connected again"

    async def _on_heartbeat(self, msg) -> None:
        try:
            hb = protocol.decode(msg.data, WorkerHeartbeat)
        except protocol.ProtocolError:
            return
        if hb.fingerprint and hb.fingerprint != self.fingerprint and (hb.role, hb.worker_id) not in self.workers.seen:
            log.warning(
                "%s worker %s has encoder fingerprint %s, the API expects %s (different model, dtype or engine?)",
                hb.role,
                hb.worker_id,
                hb.fingerprint,
                self.fingerprint,
            )
        self.workers.update(hb)
        if self.router is not None:
            self.router.on_heartbeat(hb)
        if self.ec is not None:  # which fingerprints are served (current) and which are retired
            await self.ec.fingerprint_seen(hb.fingerprint, model=hb.model)
            await self.ec.fingerprint_seen(
                self.fingerprint, model=self.model_name, model_path=str(self.identity.model_path)
            )

    # -- request pipeline ------------------------------------------------------------------
    async def load_images(self, urls: list[str]) -> list[LoadedImage]:
        """Fetch and decode every image (side by side; decodes wait for the process's decode budget)."""
        media = await self.load_media([MediaURL(MediaKind.IMAGE, u) for u in urls], VideoSampling())
        return [m for m in media if isinstance(m, LoadedImage)]

    def video_sampling(self, requested: VideoSampling) -> VideoSampling:
        """A request's video sampling with the server's defaults filling what it leaves unset
        (``EPD_VIDEO_NUM_FRAMES`` only where the loader takes a frame count)."""
        media = self.settings.media
        num_frames = requested.num_frames
        if num_frames is None and self.video_sampler is VideoSampler.UNIFORM:
            num_frames = media.video_num_frames
        return VideoSampling(num_frames=num_frames, fps=requested.fps if requested.fps is not None else media.video_fps)

    async def load_media(self, media: list[MediaURL], sampling: VideoSampling) -> list[LoadedImage | SampledVideo]:
        """Fetch and decode every image and video, side by side (decodes wait for the process's
        decode budget); a video only where the served model takes video (else a 400 before any
        fetch), each sampled once, here (workers get its frames)."""
        assert self.fetcher is not None and self.video_fetcher is not None
        if any(m.kind is MediaKind.VIDEO for m in media):
            check_video(self.identity.engine, self.family)
            sampling = self.video_sampling(sampling)
            check_sampling(self.video_sampler, sampling)

        fetcher, video_fetcher = self.fetcher, self.video_fetcher

        async def load(m: MediaURL) -> LoadedImage | SampledVideo:
            if m.kind is MediaKind.IMAGE:
                return await load_image(m.url, fetcher, self.limits, budget=self.decode_budget)
            return await load_video_url(
                m.url,
                video_fetcher,
                sampler=self.video_sampler,
                sampling=sampling,
                limits=self.video_limits,
                budget=self.decode_budget,
            )

        loads: list[asyncio.Task[LoadedImage | SampledVideo]] = [asyncio.create_task(load(m)) for m in media]
        try:
            loaded = list(await asyncio.gather(*loads))
        except BaseException:
            for task in loads:  # one bad item fails the request: stop waiting for the others
                task.cancel()
            raise
        if not self.video_segment_frames:
            return loaded
        return [
            split_segments(item, self.video_segment_frames, self.video_temporal_patch)
            if isinstance(item, SampledVideo)
            else item
            for item in loaded
        ]

    @property
    def uses_encoder(self) -> bool:
        """Whether requests get encode jobs (not in agg: its worker encodes in process)."""
        return TOPOLOGIES[self.settings.topology].uses_encoder

    async def prepare_images(self, request_id: str, urls: list[str]) -> list[ImageRef]:
        """Load every image, store each distinct one, queue encode jobs. Returns refs in order."""
        assert self.client is not None
        loaded = await self.load_images(urls)
        return await self.client.image_refs(request_id, loaded, encode=self.uses_encoder)

    async def submit(
        self,
        request_id: str,
        parsed: ParsedRequest,
        images: Sequence[LoadedImage | SampledVideo],
        received_at: float,
        deadline: float,
    ) -> ChoiceStreams:
        """Submit the request (``RequestClient.submit_choices``: images and encode jobs once, then
        a record and a generation job per choice - :func:`choice_ids`, :func:`choice_sampling`);
        the choices' token streams, bounded by ``deadline`` (at which the request is recorded as
        abandoned by the API)."""
        assert self.client is not None
        submission = Submission(
            request_id=request_id,
            model=parsed.model,
            messages=[m.to_wire() for m in parsed.messages],
            sampling=parsed.sampling,
            stream=parsed.stream,
            received_at=received_at,
            deadline=deadline,
            body=redact_images(parsed.body, [item_hash_of(img) for img in images]),
            images=images,
            prompt=parsed.prompt,
            tools=parsed.tools,
        )
        choices = [(rid, choice_sampling(parsed.sampling, i)) for i, rid in enumerate(choice_ids(request_id, parsed.n))]
        return await self.client.submit_choices(
            submission, choices, encode=self.uses_encoder, on_abandon=self.client.abandon
        )

    async def record_refused(
        self, request_id: str, received_at: float, parsed: ParsedRequest | None, error: EPDError
    ) -> None:
        """Record a request refused before any job was published (``RequestClient.record_refused``):
        its body as parsed (images as their recorded URLs; none when it did not parse)."""
        if self.client is None or self.nc is None or not self.nc.is_connected:
            return
        body = redact_images(parsed.body, [""] * len(parsed.image_urls)) if parsed is not None else {}
        record = ChatRequestRecord(
            request_id=request_id,
            received_at=received_at,
            model=parsed.model if parsed is not None else self.model_name,
            body=body,
        )
        await self.client.record_refused(record, error)

    def spawn(self, coro: Any) -> None:
        """Run ``coro`` in the background, outside the request's task: what must happen after the
        client went away (its task is being cancelled, so awaiting there would be cancelled too)."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def cancel_in_background(self, events: ChoiceStreams, error: EPDError) -> None:
        """Give up on a request that has not ended: its workers stop (``RequestClient.abandon``)."""
        if not events.ended:
            self.spawn(events.cancel(error))


def router_tuning(settings: ApiSettings) -> RouterTuning:
    """What the router is handed of the API's settings."""
    return RouterTuning(
        affinity_weight=settings.routing_affinity_weight,
        load_weight=settings.routing_load_weight,
        affinity_timeout_s=settings.routing_affinity_timeout_s,
        takeover_s=settings.routing_takeover_s,
        worker_stale_s=settings.worker_stale_s,
    )
