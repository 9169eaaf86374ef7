"""Queue replay end to end: real NATS, real S3 server, real api/encoder/prefill processes.

``show`` finds every message of a request on every stream and draws its stage timeline; ``run``
re-runs a recorded request on the live workers (greedy and sampled both reproduce; a new seed is
the negative control); a case exported with its image and imported into a fresh NATS + empty
bucket replays there; unknown ids, expired messages and an unreachable NATS give clear errors;
the waterfall page renders the stages (API and CLI). The CLI runs in a subprocess that must not
import torch.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import time
import uuid

import httpx
import nats
import pytest

from shared import history, protocol
from shared.config import ToolSettings
from shared.engines.base import SamplingParams
from shared.jetstream import ensure_topology
from shared.media import content_hash_of
from shared.protocol import (
    HDR_RECEIVED_AT,
    HDR_STAGE,
    HDR_STARTED_AT,
    ChatRequestRecord,
    ECReady,
    FinalResult,
    Subjects,
)
from shared.store.objects import S3ObjectStore
from shared.timeline import build_timeline
from shared.tools import replay
from shared.tools.infra import EmbeddedNats, free_port
from shared.tools.launcher import Stack
from tests.stackutil import (
    data_url,
    engine_encode,
    engine_messages,
    engine_tokens,
    epd_cli,
    noise_image,
    stack_env,
    user_message,
)

pytestmark = pytest.mark.slow

GREEDY = dict(temperature=0, max_tokens=8, ignore_eos=True, return_token_ids=True)
SAMPLED = dict(temperature=1.0, top_p=0.95, max_tokens=12, ignore_eos=True, return_token_ids=True)
IMAGE_STAGES = (
    "received",
    "encode queued",
    "encode",
    "EC stored",
    "generation queued",
    "EC loaded from store",
    "prefill",
    "first token",
    "decode",
    "done",
)


def with_nats(url: str, fn):
    async def main():
        nc = await nats.connect(url)
        try:
            return await fn(nc)
        finally:
            await nc.close()

    return asyncio.run(main())


def find_case(stack, request_id: str) -> history.RequestCase:
    return with_nats(stack.nats_url, lambda nc: history.find_case(nc, stack.subjects, request_id))


def bucket_store(s3_server, bucket: str) -> S3ObjectStore:
    return S3ObjectStore(s3_server.endpoint, s3_server.access_key, s3_server.secret_key, bucket)


def run_replay(stack, s3_server, request_id: str, **kw) -> replay.ReplayOutcome:
    store = bucket_store(s3_server, stack.bucket)
    return with_nats(
        stack.nats_url,
        lambda nc: replay.replay_request(nc, stack.subjects, request_id, namespace=stack.namespace, store=store, **kw),
    )


def chat_id(stack, image_seed: int | None, **params) -> tuple[str, list[int]]:
    urls = [data_url(noise_image(image_seed, (56, 56)))] if image_seed is not None else []
    resp = stack.chat([user_message("Describe the image.", urls)], **params)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    return body["id"], body["choices"][0]["token_ids"]


# -- show -------------------------------------------------------------------------------------
def test_show_lists_every_stage_of_an_image_request(epd_stack):
    rid, tokens = chat_id(epd_stack, 301, **GREEDY)
    case = find_case(epd_stack, rid)
    s = epd_stack.subjects
    assert {m.stream for m in case.messages} == {
        s.stream_requests,
        s.stream_encode,
        s.stream_events,
        s.stream_generate,
        s.stream_results,
    }
    assert [m.time for m in case.messages] == sorted(m.time for m in case.messages)
    kinds = [m.kind for m in case.messages]
    assert kinds.count("chat_request") == kinds.count("encode_job") == kinds.count("ec_ready") == 1
    # 7 chunks and the result with the last one (FinalResult.last_chunk)
    assert kinds.count("generation_job") == 1 and kinds.count("token_chunk") == 7 and kinds[-1] == "final_result"
    assert case.final.last_chunk is not None and case.final.last_chunk.seq == 7
    assert [m.msg.seq for m in case.chunks()] == list(range(8))
    # request_id and stage timestamps travel in the headers of every message
    for m in case.messages:
        assert m.request_id == rid
        assert m.headers[HDR_STAGE] in ("api", "encoder", "prefill")
        assert float(m.headers[HDR_RECEIVED_AT]) == pytest.approx(case.record.received_at, abs=1e-5)
        if m.headers[HDR_STAGE] != "api":
            assert float(m.headers[HDR_STARTED_AT]) <= m.time
    assert case.final.token_ids == tuple(tokens)

    tl = build_timeline(case)
    by = {st.name: st for st in tl.stages}
    assert all(name in by for name in IMAGE_STAGES), tl.names()
    ready: ECReady = case.of(ECReady)[0].msg
    assert by["encode"].duration == pytest.approx(ready.encode_s, abs=1e-5) and ready.encode_s > 0
    order = [
        by["received"].start,
        by["encode queued"].start,
        by["encode"].start,
        by["EC stored"].end,
        by["EC loaded from store"].end,
        by["prefill"].start,
        by["first token"].start,
        by["done"].start,
    ]
    assert order == sorted(order), order
    assert tl.summary.status == "ok" and tl.summary.images == 1 and tl.summary.completion_tokens == 8
    assert 0 < tl.summary.ttft_s < tl.summary.e2e_s

    # The CLI prints every stage, and with --messages every message; --json has the same timeline.
    out = epd_cli(epd_stack.env, "replay", "show", rid, "--messages")
    assert out.returncode == 0, out.stderr
    for name in IMAGE_STAGES:
        assert f" {name} " in out.stdout, name
    heads = [ln.split()[-1] for ln in out.stdout.splitlines() if re.match(r"^\s+[+-]\d+\.\d ms  ", ln)]
    assert heads == kinds  # one entry per message, in time order
    js_out = epd_cli(epd_stack.env, "replay", "show", rid, "--json")
    assert [st["name"] for st in json.loads(js_out.stdout)["timeline"]["stages"]] == tl.names()

    listed = epd_cli(epd_stack.env, "replay", "list", "--since", "10m", "--limit", "50")
    assert listed.returncode == 0, listed.stderr
    line = next(ln for ln in listed.stdout.splitlines() if ln.startswith(rid))
    assert " ok " in line and "images 1" in line and "tokens    8" in line and "TTFT" in line

    # The same image again: no encode job (already stored), features from the worker's cache; the
    # first request's encode event is history, not part of this request.
    again_rid, again_tokens = chat_id(epd_stack, 301, **GREEDY)
    again = find_case(epd_stack, again_rid)
    assert again_tokens == tokens and not again.of(ECReady)
    names = build_timeline(again).names()
    assert "no encode job" in names and "EC from local cache" in names and "encode" not in names

    # Control: a text-only request has no encode stages and no messages on the encode streams.
    text_rid, _ = chat_id(epd_stack, None, **GREEDY)
    text_case = find_case(epd_stack, text_rid)
    assert {m.stream for m in text_case.messages} == {s.stream_requests, s.stream_generate, s.stream_results}
    names = build_timeline(text_case).names()
    assert "encode" not in names and "EC stored" not in names and "done" in names


# -- run --------------------------------------------------------------------------------------
def test_replayed_greedy_request_reproduces_its_tokens(epd_stack, s3_server):
    rid, tokens = chat_id(epd_stack, 302, **GREEDY)
    out = run_replay(epd_stack, s3_server, rid)
    assert out.replay_id != rid and out.greedy
    assert isinstance(out.result, FinalResult)
    assert list(out.result.token_ids) == tokens == list(out.recorded.token_ids)
    assert out.identical is True and out.first_difference is None
    # The replay is recorded as a request of its own, pointing at the original.
    again = find_case(epd_stack, out.replay_id)
    assert again.record.replay_of == rid and again.final.token_ids == tuple(tokens)
    assert build_timeline(again).stages[0].service == "replay"

    cli = epd_cli(epd_stack.env, "replay", "run", rid, "--compare")
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert "identical: yes" in cli.stdout


def test_replayed_sampled_request_reuses_the_derived_seed(epd_stack, s3_server):
    rid, tokens = chat_id(epd_stack, 303, **SAMPLED)  # no client seed: the worker derived one from rid
    same = run_replay(epd_stack, s3_server, rid)
    assert same.seed == protocol.effective_seed(rid, None)
    assert same.identical is True and list(same.result.token_ids) == tokens
    # Negative control: sampling with the replay's own seed gives other tokens, and the diff shows them.
    other = run_replay(epd_stack, s3_server, rid, keep_seed=False)
    assert other.identical is False and other.first_difference is not None
    assert "[-" in other.diff() and "{+" in other.diff()

    cli = epd_cli(epd_stack.env, "replay", "run", rid, "--compare", "--new-seed")
    assert cli.returncode == replay_cli_exit_different(), cli.stdout + cli.stderr
    assert "identical: NO" in cli.stdout and "first difference at token" in cli.stdout


def replay_cli_exit_different() -> int:
    from shared.tools.replay_cli import EXIT_DIFFERENT

    return EXIT_DIFFERENT


# -- errors -----------------------------------------------------------------------------------
def test_unknown_ids_expired_messages_and_unreachable_nats_are_clear_errors(epd_stack, nats_server):
    env = epd_stack.env
    unknown = epd_cli(env, "replay", "show", f"chatcmpl-{uuid.uuid4().hex}")
    assert unknown.returncode == 2 and "request_not_found" in unknown.stderr
    assert f"{epd_stack.subjects.stream_requests} keeps messages for 86400 s" in unknown.stderr
    bad = epd_cli(env, "replay", "show", "a.b")
    assert bad.returncode == 2 and "invalid_request_id" in bad.stderr
    wrong_prefix = epd_cli(env, "replay", "list", "--prefix", "nosuchprefix")
    assert wrong_prefix.returncode == 2 and "does not exist on this NATS server" in wrong_prefix.stderr

    # It gives up instead of reconnecting forever (epd_cli's timeout bounds a hang).
    down = epd_cli(env, "replay", "list", "--nats-url", f"nats://user:hunter2@127.0.0.1:{free_port()}")
    assert down.returncode == 2 and "cannot connect to NATS" in down.stderr
    assert "hunter2" not in down.stderr + down.stdout

    # A request whose generation job was trimmed from its stream: shown, but not replayable.
    rid, _ = chat_id(epd_stack, None, **GREEDY)
    case = find_case(epd_stack, rid)
    gen = next(m for m in case.messages if m.kind == "generation_job")
    with_nats(epd_stack.nats_url, lambda nc: nc.jetstream().delete_msg(gen.stream, gen.seq))
    with pytest.raises(replay.MessagesExpired, match="no generation job left"):
        with_nats(
            epd_stack.nats_url,
            lambda nc: replay.replay_request(nc, epd_stack.subjects, rid, namespace=epd_stack.namespace),
        )
    trimmed = find_case(epd_stack, rid)
    assert "generation queued" not in build_timeline(trimmed).names() and trimmed.final is not None

    # Messages that aged out of their stream: the error says how long the stream keeps them.
    prefix = f"exp{uuid.uuid4().hex[:8]}"
    settings = ToolSettings(nats_url=nats_server.url, subject_prefix=prefix, stream_max_age_s=1, dup_window_s=1)
    subjects = Subjects(prefix)

    async def record_then_expire(nc):
        js = nc.jetstream()
        await ensure_topology(js, settings.nats, subjects)
        rec = ChatRequestRecord(request_id="chatcmpl-old", received_at=time.time(), model="m", body={})
        from shared.jetstream import JetStreamPublisher

        await JetStreamPublisher(js).publish(subjects.request("chatcmpl-old"), rec, request_id="chatcmpl-old")
        found = await history.find_case(nc, subjects, "chatcmpl-old")
        assert found.record == rec  # control: it is found while it is there
        deadline = time.monotonic() + 120  # max_age 1 s: bounds a server that never expires it
        while (await js.stream_info(subjects.stream_requests)).state.messages and time.monotonic() < deadline:
            await asyncio.sleep(0.25)
        try:
            with pytest.raises(history.RequestNotFound, match="keeps messages for 1 s and is empty now"):
                await history.find_case(nc, subjects, "chatcmpl-old")
        finally:
            for stream in subjects.streams():
                await js.delete_stream(stream)

    with_nats(nats_server.url, record_then_expire)


# -- export / import --------------------------------------------------------------------------
def test_exported_case_imported_into_a_fresh_nats_replays(epd_stack, s3_server, tiny_model_dir, tmp_path):
    image = noise_image(304, (56, 56))
    item = content_hash_of(image)
    resp = epd_stack.chat([user_message("What is this?", [data_url(image)])], **GREEDY)
    assert resp.status_code == 200, resp.text
    rid, tokens = resp.json()["id"], resp.json()["choices"][0]["token_ids"]

    case_file, bare_file = tmp_path / "case.json", tmp_path / "bare.json"
    out = epd_cli(epd_stack.env, "replay", "export", rid, "-o", str(case_file))
    assert out.returncode == 0, out.stderr
    assert epd_cli(epd_stack.env, "replay", "export", rid, "-o", str(bare_file), "--no-media").returncode == 0
    doc = json.loads(case_file.read_text())
    (exported,) = doc["cases"]
    assert exported["request_id"] == rid and [m["item_hash"] for m in exported["media"]] == [item]
    assert len(exported["messages"]) == len(find_case(epd_stack, rid).messages)
    assert json.loads(bare_file.read_text())["cases"][0]["media"] == []

    fresh = EmbeddedNats(tmp_path / "fresh-nats")
    fresh.start()
    stack = None
    try:
        env, prefix, namespace, bucket = stack_env(fresh, s3_server, tiny_model_dir)
        imp = epd_cli(env, "replay", "import", str(case_file))
        assert imp.returncode == 0, imp.stderr
        assert f"imported {rid}" in imp.stdout and "1 image(s) into the store" in imp.stdout
        again = epd_cli(env, "replay", "import", str(case_file))
        assert f"skipped {rid}" in again.stdout  # importing twice adds nothing

        shown = epd_cli(env, "replay", "show", rid, "--no-messages")
        assert shown.returncode == 0, shown.stderr
        assert "(imported)" in shown.stdout and all(f" {n} " in shown.stdout for n in IMAGE_STAGES)

        # Live workers on the fresh cluster: one prefill worker, no encoder, empty bucket.
        stack = Stack(env=env, log_dir=tmp_path / "fresh-logs", api_port=free_port())
        stack.add("prefill")
        store = bucket_store(s3_server, bucket)
        outcome = with_nats(
            fresh.url,
            lambda nc: replay.replay_request(
                nc, Subjects(prefix), rid, namespace=namespace, store=store, worker_wait_s=240
            ),
        )
        assert outcome.identical is True and list(outcome.result.token_ids) == tokens
        # No EC object here: the worker encoded the imported image itself.
        assert outcome.result.ec_sources == {item: "recomputed:not_found"}

        # Negative control: without its image the case cannot be replayed, and says why.
        env2 = {**env, "EPD_SUBJECT_PREFIX": f"{prefix}b", "EPD_NAMESPACE": f"{namespace}b"}
        assert epd_cli(env2, "replay", "import", str(bare_file)).returncode == 0
        bare = epd_cli(env2, "replay", "run", rid, "--wait-workers", "1")
        assert bare.returncode == 2 and "media_expired" in bare.stderr and item[:16] in bare.stderr
    finally:
        if stack is not None:
            stack.stop()
        fresh.stop()


# -- the picture ------------------------------------------------------------------------------
def test_waterfall_page_renders_the_stages(epd_stack, tmp_path):
    rid, _ = chat_id(epd_stack, 305, **GREEDY)
    case = find_case(epd_stack, rid)
    ready: ECReady = case.of(ECReady)[0].msg
    resp = httpx.get(f"{epd_stack.url}/debug/requests/{rid}", timeout=30)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/html")
    page = resp.text
    assert rid in page and "<svg" in page
    for name in IMAGE_STAGES:
        assert f">{name}<" in page, name
    assert f"{ready.encode_s * 1e3:.1f} ms" in page  # the encode bar's real duration
    assert "<script" not in page and "<link" not in page and " src=" not in page  # self-contained

    as_json = httpx.get(f"{epd_stack.url}/debug/requests/{rid}", params={"format": "json"}, timeout=30).json()
    assert [st["name"] for st in as_json["timeline"]["stages"]] == build_timeline(case).names()

    html_file = tmp_path / "waterfall.html"
    cli = epd_cli(epd_stack.env, "replay", "show", rid, "--html", str(html_file), "--no-messages")
    assert cli.returncode == 0, cli.stderr
    written = html_file.read_text()
    assert "<svg" in written and all(f">{n}<" in written for n in IMAGE_STAGES)

    missing = httpx.get(f"{epd_stack.url}/debug/requests/chatcmpl-{uuid.uuid4().hex}", timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "request_not_found"


def test_debug_page_requires_the_api_key_when_keys_are_set(api_only_stack):
    url = f"{api_only_stack.url}/debug/requests/chatcmpl-{uuid.uuid4().hex}"
    assert httpx.get(url, timeout=30).status_code == 401
    resp = httpx.get(url, headers={"Authorization": "Bearer sk-test-2"}, timeout=30)
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "request_not_found"


def test_show_and_run_follow_a_request_through_separate_decode_workers(epd_stack_epd, s3_server):
    """E|P|D: the decode job and the decode worker's messages join the case and the timeline."""
    rid, tokens = chat_id(epd_stack_epd, 306, **GREEDY)
    case = find_case(epd_stack_epd, rid)
    s = epd_stack_epd.subjects
    assert s.stream_decode in {m.stream for m in case.messages}
    assert {m.stage for m in case.messages} == {"api", "encoder", "prefill", "decode"}
    by = {st.name: st for st in build_timeline(case).stages}
    for name in ("EC loaded from store", "prefill", "first token", "KV hand-off", "decode queued", "decode", "done"):
        assert name in by, name
    assert by["decode"].service == "decode" and by["KV hand-off"].end <= by["decode"].start
    out = run_replay(epd_stack_epd, s3_server, rid)
    assert out.identical is True and list(out.result.token_ids) == tokens


def test_replayed_sampled_e_p_d_requests_reproduce_their_tokens(epd_stack_epd, reference_engine):
    """E|P|D sampled: the prefill worker samples the first token, the decode worker the rest with
    the RNG state the KV object carries. `epd replay run --compare` reproduces every token, for a
    client seed and for the seed derived from the request id; `--new-seed` differs."""
    stack, image = epd_stack_epd, noise_image(307, (56, 56))

    def sampled_reference(seed: int) -> list[int]:
        params = SamplingParams(
            max_tokens=SAMPLED["max_tokens"],
            temperature=SAMPLED["temperature"],
            top_p=SAMPLED["top_p"],
            seed=seed,
            ignore_eos=True,
        )
        return engine_tokens(
            reference_engine,
            engine_messages("Describe the image.", 1),
            engine_encode(reference_engine, [image]),
            params,
        )

    def replay_cli(rid: str, *extra: str) -> tuple[subprocess.CompletedProcess, str]:
        out = epd_cli(stack.env, "replay", "run", rid, "--compare", "--timeout", "300", *extra)
        replayed = re.search(rf"^replayed {re.escape(rid)} as (\S+) ", out.stdout, re.M)
        assert replayed, out.stdout + out.stderr
        replay_id = replayed[1]
        # The replay went through the split stages: a decode job, tokens from the decode worker.
        case = find_case(stack, replay_id)
        assert stack.subjects.stream_decode in {m.stream for m in case.messages}
        assert "decode" in {m.stage for m in case.messages}
        return out, replay_id

    derived_rid, derived = chat_id(stack, 307, **SAMPLED)  # no client seed: derived from the id
    seeded_rid, seeded = chat_id(stack, 307, seed=4242, **SAMPLED)
    derived_seed = protocol.effective_seed(derived_rid, None)
    assert derived == sampled_reference(derived_seed) and seeded == sampled_reference(4242)
    for rid, seed in ((derived_rid, derived_seed), (seeded_rid, 4242)):
        same, _ = replay_cli(rid)
        assert same.returncode == 0, same.stdout + same.stderr
        assert f"(sampled, seed {seed})" in same.stdout and "identical: yes" in same.stdout

    # Negative controls: the replay's own seed differs (the CLI says so and exits 1), and so does
    # another client seed - the equalities above are not those of any sampled run.
    other, other_id = replay_cli(derived_rid, "--new-seed")
    assert other.returncode == replay_cli_exit_different(), other.stdout + other.stderr
    assert "identical: NO" in other.stdout
    assert find_case(stack, other_id).final.token_ids != tuple(derived)
    assert chat_id(stack, 307, seed=4243, **SAMPLED)[1] != seeded
