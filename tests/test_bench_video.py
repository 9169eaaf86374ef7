"""``epd bench run``'s video workload (issue 43 item 6): ``video_share`` of the requests with media
send one synthetic clip (``workload.video_clip``: mp4 at ``CLIP_FPS``, deterministic from the seed)
of ``video_frames`` frames at a ``video_sizes`` size, with ``media_io_kwargs.video.fps`` = the clip's
rate, so the loader samples every frame; ``video_repeat_share`` of them send again one of the last
``repeat_window`` clips. The plan is checked request by request and the clips decoded with the
server's loader; a short real run on the session's e-pd stack sends them, and the server sees a
repeated clip as the same item."""

from __future__ import annotations

import base64
import hashlib
import json
import math

import pytest

from shared.tools.bench import schema, workload
from shared.tools.bench.schema import WorkloadSpec
from shared.video import VideoSampler, VideoSampling, load_video
from tests.stackutil import epd_cli

VIDEO = dict(
    requests=400,
    text_only_share=0.1,
    video_share=0.5,
    video_frames=(4, 12),
    video_sizes={"224x224": 0.5, "448x320": 0.5},
    video_repeat_share=0.4,
    repeat_share=0.3,
    repeat_window=4,
    image_sizes={"64x64": 1.0},
    prompt_words=(2, 4),
    output_tokens=(4, 4),
)


def spec(**fields) -> WorkloadSpec:
    return workload.check_spec(WorkloadSpec(**fields))


def clip_of(req: workload.PlannedRequest) -> bytes:
    (clip,) = req.videos
    return workload.clip_bytes(req.seed, req.run_index, clip.id, clip.frames, clip.width, clip.height)


def within(count: int, total: int, p: float) -> None:
    sigma = math.sqrt(p * (1 - p) / total)
    assert abs(count / total - p) < 5 * sigma, (count, total, p)


def test_video_workload_plans_clips_of_the_asked_frames_sizes_and_repeats():
    reqs = workload.plan(spec(seed=5, **VIDEO))
    assert {r.kind for r in reqs} == {"text", "image", "repeat", "video", "video_repeat"}
    videos = [r for r in reqs if r.videos]
    media = [r for r in reqs if r.kind != "text"]
    within(len(videos), len(media), 0.5)
    assert all(len(r.videos) == 1 and not r.images and r.kind.startswith("video") for r in videos)
    assert all(not r.videos for r in reqs if not r.kind.startswith("video"))
    within(sum(r.kind == "video_repeat" for r in videos), len(videos), 0.4)
    fresh = {r.videos[0].id: r.videos[0] for r in videos if r.kind == "video"}
    assert {c.frames for c in fresh.values()} == set(range(4, 13))
    assert {(c.width, c.height) for c in fresh.values()} == {(224, 224), (448, 320)}
    # a repeat sends one of the last repeat_window distinct clips; a "video" request a new one
    seen: list[int] = []
    for r in videos:
        cid = r.videos[0].id
        if r.kind == "video_repeat":
            assert cid in seen[-4:], (r.index, cid, seen[-4:])
        else:
            assert cid not in seen
            seen.append(cid)
    # distinct clips only, or one clip sent again and again
    distinct = [r for r in workload.plan(spec(seed=5, **{**VIDEO, "video_repeat_share": 0.0})) if r.videos]
    assert [r.kind for r in distinct] == ["video"] * len(distinct)
    assert len({r.videos[0].id for r in distinct}) == len(distinct)
    again = [r for r in workload.plan(spec(seed=5, **{**VIDEO, "video_repeat_share": 1.0})) if r.videos]
    assert {r.videos[0].id for r in again} == {0} and [r.kind for r in again[:2]] == ["video", "video_repeat"]

    # the body: the clip as a data URL, every frame sampled (fps = the clip's rate) by either loader
    first = next(r for r in videos if r.kind == "video" and r.videos[0].frames % 2 == 0)
    shape = (first.videos[0].frames, first.videos[0].width, first.videos[0].height)
    # another clip of the same frames and size
    second = next(
        r
        for r in videos
        if r.kind == "video" and r is not first and (r.videos[0].frames, r.videos[0].width, r.videos[0].height) == shape
    )
    body = first.body("m")
    assert body["media_io_kwargs"] == {"video": {"fps": workload.CLIP_FPS}}
    (part,) = [p for p in body["messages"][0]["content"] if p["type"] != "text"]
    data = base64.b64decode(part["video_url"]["url"].removeprefix("data:video/mp4;base64,"))
    assert data == clip_of(first)
    clip = first.videos[0]
    for sampler in (VideoSampler.QWEN2_VL, VideoSampler.UNIFORM):
        sampled = load_video(data, sampler, VideoSampling(fps=workload.CLIP_FPS))
        assert sampled.frames.shape == (clip.frames, clip.height, clip.width, 3), sampler
    assert "media_io_kwargs" not in next(r for r in reqs if r.images).body("m")
    # deterministic from the seed; another clip (or the next run of a sweep) is other bytes
    assert clip_of(workload.plan(spec(seed=5, **VIDEO))[first.index]) == clip_of(first)
    assert clip_of(second) != clip_of(first)
    assert clip_of(workload.plan(spec(seed=5, **VIDEO), run_index=1)[first.index]) != clip_of(first)


#: the digest of seed 11's plan below as the workload drew it before videos existed (commit b6f9de7)
PLAN_BEFORE_VIDEO = "b803aef6529a70dce93d70b05ce418c37a5513869f9110cd6c107e15d47b5a12"


def _digest(reqs: list[workload.PlannedRequest]) -> str:
    rows = [[r.kind, [[i.id, i.width, i.height] for i in r.images], r.prompt, r.output_tokens, r.turn] for r in reqs]
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()


def test_a_workload_without_video_plans_what_it_planned_before():
    """Videos are decided by a random stream of their own: with ``video_share`` 0 a plan is the one
    the workload drew before videos existed (earlier results stay comparable), whatever the other
    video fields say."""
    base = dict(requests=200, text_only_share=0.2, repeat_share=0.4, images_per_request={1: 0.5, 2: 0.5})
    plain = workload.plan(spec(seed=11, **base))
    assert _digest(plain) == PLAN_BEFORE_VIDEO
    assert workload.plan(spec(seed=11, **base, video_frames=(4, 32), video_sizes={"448x448": 1.0})) == plain
    assert workload.plan(spec(seed=11, **base, video_share=0.3)) != plain  # the control


def test_video_flags_and_their_bounds():
    from shared.tools.bench.cli import spec_from_args
    from shared.tools.cli import build_parser

    args = build_parser().parse_args(
        [
            "bench",
            "run",
            "--url",
            "http://x",
            "--video-share",
            "0.7",
            "--video-frames",
            "8,16",
            "--video-sizes",
            "224x224:1,448x448:3",
            "--video-repeat-share",
            "0.25",
        ]
    )
    s = spec_from_args(args)
    assert (s.video_share, s.video_frames, s.video_sizes, s.video_repeat_share) == (
        0.7,
        (8, 16),
        {"224x224": 1.0, "448x448": 3.0},
        0.25,
    )
    for bad in ({"video_frames": (2, 8)}, {"video_frames": (8, 40)}, {"video_share": 1.5}, {"video_sizes": {"x": 1}}):
        with pytest.raises(ValueError, match="invalid workload"):
            workload.load_spec(None, bad)


@pytest.mark.slow
def test_bench_run_sends_the_video_workload(epd_stack, tmp_path):
    flags = dict(requests=5, video_share=1.0, video_frames=(4, 6), video_sizes={"224x224": 1.0}, output_tokens=(4, 4))
    seed = next(
        s
        for s in range(100, 1000)
        if [r.kind for r in workload.plan(spec(seed=s, **flags, video_repeat_share=0.5))].count("video_repeat") == 2
    )
    planned = workload.plan(spec(seed=seed, **flags, video_repeat_share=0.5))
    out = tmp_path / "video.json"
    proc = epd_cli(
        {},
        "bench",
        "run",
        "--url",
        epd_stack.url,
        "--requests",
        "5",
        "--video-share",
        "1",
        "--video-frames",
        "4,6",
        "--video-sizes",
        "224x224",
        "--video-repeat-share",
        "0.5",
        "--output-tokens",
        "4",
        "--seed",
        str(seed),
        "--out",
        str(out),
        "--no-progress",
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    recs = schema.load(out.read_bytes()).runs[0].requests
    assert [(r.index, r.kind, r.images, r.videos) for r in recs] == [(p.index, p.kind, 0, 1) for p in planned]
    for r in recs:
        assert r.ok and r.output_tokens == 4 and r.prompt_tokens > 0, r
        assert len(r.ec_sources) == 1, r.ec_sources  # the clip is one item (4-6 frames: one segment)
    # the server sees a repeated clip as the item it saw before, and distinct clips as distinct items
    hashes: dict[int, set[str]] = {}
    for p, r in zip(planned, recs):
        hashes.setdefault(p.videos[0].id, set()).update(r.ec_sources)
    assert len(hashes) == 3 and all(len(h) == 1 for h in hashes.values()), hashes
    assert len(set.union(*hashes.values())) == 3
