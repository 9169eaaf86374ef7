"""Sampling parity across the E|P|D hand-off, through the real workers (in process) against the
session's NATS and S3: a prefill worker (role ``prefill``) samples and streams the first token,
writes the KV object and publishes the DecodeJob; a decode worker continues from it. With every
sampling parameter set at once (greedy and seeded) the streamed tokens, text and logprobs equal
the aggregated engine's - penalties and ``min_tokens`` state cross the hand-off - also when the
decode job is delivered again, and for a completions prompt. Role ``pd`` (E|PD) too.

Negative controls (mutations): a decode worker that drops one parameter of the job's sampling
gives other tokens, so the equality can fail.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import replace

import pytest

from shared import protocol
from shared.config import DecodeSettings, PrefillSettings
from shared.engines.base import RawPrompt
from shared.model_worker import sampling_params
from shared.protocol import DecodeJob, FinalResult, GenerationJob, SamplingSpec, Subjects, TokenChunk
from tests.stackutil import run_sync, stack_env

LOOPY = [{"role": "user", "content": [{"type": "text", "text": "a a a a a a a a"}]}]
#: a stop token id pushed up by its bias: min_tokens holds it back past the hand-off, then it
#: ends the completion (without min_tokens on the decode side it would end at once)
STOP_ID = 7
MIN_TOKENS = 15
COMMON = dict(
    max_tokens=30,
    top_k=8,
    min_p=0.02,
    presence_penalty=-0.5,
    frequency_penalty=1.0,
    repetition_penalty=1.3,
    logit_bias=((STOP_ID, 4.0), (91, 1.5), (300, -2.0)),
    min_tokens=MIN_TOKENS,
    stop_token_ids=(STOP_ID,),
    logprobs=2,
)
GREEDY_ALL = SamplingSpec(temperature=0.0, **COMMON)
SEEDED_ALL = SamplingSpec(temperature=0.8, top_p=0.95, seed=1234, **COMMON)


@pytest.fixture(scope="module")
def env(nats_server, s3_server, tiny_model_dir):
    env, *_ = stack_env(nats_server, s3_server, tiny_model_dir)
    return {k[4:].lower(): v for k, v in env.items()}


async def _aggregated(engine, prompt, spec: SamplingSpec):
    rid = "agg"
    params = sampling_params(spec, seed=protocol.effective_seed(rid, spec.seed))
    return [e async for e in engine.generate(prompt, [], params)]


def _job(rid: str, spec: SamplingSpec, *, prompt=None, messages=None) -> GenerationJob:
    return GenerationJob(
        request_id=rid,
        model="qwen2-vl-tiny",
        messages=messages or [],
        images=(),
        fingerprint="",
        sampling=spec,
        stream=True,
        deadline=time.time() + 120,
        created_at=time.time(),
        prompt=prompt,
    )


class Workers:
    """A prefill worker (``role``) and, for E|P|D, a decode worker, in this process on one engine."""

    def __init__(self, env, engine, role: str):
        self.env, self.engine, self.role = env, engine, role

    async def __aenter__(self):
        from services.decode.handler import DecodeHandler
        from services.prefill.handler import PrefillHandler
        from shared.jetstream import JetStreamPublisher, connect, ensure_topology
        from shared.worker import WorkerContext

        settings = PrefillSettings(**self.env, role=self.role)
        self.subjects = Subjects(settings.nats.subject_prefix)
        self.nc = await connect(settings.nats, name="test-sampling")
        js = self.nc.jetstream()
        await ensure_topology(js, settings.nats, self.subjects)
        ctx = WorkerContext(settings, self.subjects, JetStreamPublisher(js), self.nc)
        self.prefill = PrefillHandler(settings, engine=self.engine)
        await self.prefill.setup(ctx)
        self.decode = None
        if self.role == "prefill":
            dsettings = DecodeSettings(**self.env, kv_sweep_interval_s=0)
            self.decode = DecodeHandler(dsettings, engine=self.engine)
            await self.decode.setup(WorkerContext(dsettings, self.subjects, JetStreamPublisher(js), self.nc))
        return self

    async def __aexit__(self, *exc):
        await self.prefill.close()
        if self.decode is not None:
            await self.decode.close()
        await self.nc.close()

    async def run(self, job: GenerationJob) -> tuple[list[TokenChunk], FinalResult, DecodeJob | None]:
        """Prefill (and decode) ``job``; its token chunks (by seq), final result and decode job."""
        from shared.worker import settle

        rid = job.request_id
        tokens = await self.nc.subscribe(self.subjects.tokens(rid))
        jobs = await self.nc.subscribe(self.subjects.decode_jobs)
        headers = {protocol.HDR_REQUEST_ID: rid}
        verdict = await settle(self.prefill, _delivery(job, self.subjects.generate_jobs, headers, 1))
        assert verdict.action.value == "ack", verdict
        decode_job = None
        if self.decode is not None:
            decode_job = protocol.decode((await jobs.next_msg(timeout=30)).data)
            assert isinstance(decode_job, DecodeJob) and decode_job.request_id == rid
            await self.run_decode(decode_job, 1)
        await jobs.unsubscribe()
        return (*await _collect(tokens), decode_job)

    async def run_decode(self, decode_job: DecodeJob, attempt: int) -> None:
        from shared.worker import settle

        headers = {protocol.HDR_REQUEST_ID: decode_job.request_id}
        verdict = await settle(self.decode, _delivery(decode_job, self.subjects.decode_jobs, headers, attempt))
        assert verdict.action.value == "ack", verdict

    async def redecode(self, decode_job: DecodeJob, blob: bytes, attempt: int):
        """Deliver ``decode_job`` again with its KV object back in the store (a worker that died
        before deleting it): the chunks and final result of that delivery."""
        rid = decode_job.request_id
        tokens = await self.nc.subscribe(self.subjects.tokens(rid))
        await asyncio.to_thread(self.decode.kv_store.put, decode_job.kv_key, blob)
        await self.run_decode(decode_job, attempt)
        return await _collect(tokens)


def _delivery(job, subject, headers, attempt):
    from shared.worker import Delivery

    return Delivery(protocol.encode(job), subject, headers, attempt, 5)


async def _collect(sub) -> tuple[list[TokenChunk], FinalResult]:
    chunks: list[TokenChunk] = []
    try:
        while True:
            event = protocol.decode((await sub.next_msg(timeout=60)).data)
            if isinstance(event, TokenChunk):
                chunks.append(event)
            elif isinstance(event, FinalResult):
                last, final = event.split()  # (the last token comes with the result)
                chunks += [last] if last is not None else []
                return sorted(chunks, key=lambda c: c.seq), final
            else:
                raise AssertionError(f"unexpected {event!r}")
    finally:
        await sub.unsubscribe()


def _streamed(chunks):
    return (
        [t for c in chunks for t in c.token_ids],
        "".join(c.text for c in chunks),
        [lp for c in chunks for lp in c.logprobs],
    )


def _want(events):
    return [e.token_id for e in events], "".join(e.text for e in events), [e.logprob for e in events]


def _rid(what: str) -> str:
    return f"samp-{what}-{uuid.uuid4().hex[:8]}"


@pytest.mark.parametrize("spec", [GREEDY_ALL, SEEDED_ALL], ids=["greedy", "seeded"])
def test_epd_decode_continues_with_identical_sampling(env, reference_engine, spec, monkeypatch):
    rid = _rid("epd")
    want = run_sync(_aggregated(reference_engine, LOOPY, spec))  # (greedy, or the spec's seed: as the job)

    async def main():
        async with Workers(env, reference_engine, "prefill") as w:
            chunks, final, decode_job = await w.run(_job(rid, spec, messages=LOOPY))
            gone = await asyncio.to_thread(w.decode.kv_store.store.get, decode_job.kv_key, 1 << 30)
            return gone, chunks, final, decode_job

    # run the hand-off while keeping the KV object's bytes for the redelivery below
    kept: dict[str, bytes] = {}
    from services.decode import handler as decode_handler

    real_delete = decode_handler.DecodeHandler._delete

    async def keep_then_delete(self, key):
        kept[key] = await asyncio.to_thread(self.kv_store.store.get, key, 1 << 30)
        await real_delete(self, key)

    monkeypatch.setattr(decode_handler.DecodeHandler, "_delete", keep_then_delete)
    gone, chunks, final, decode_job = run_sync(main())
    assert gone is None and decode_job.kv_key in kept  # the decode worker deleted it when done
    assert decode_job.emitted == 1 and [c.seq for c in chunks] == list(range(len(chunks)))
    got = _streamed(chunks)
    assert got == _want(want)
    assert list(final.token_ids) == got[0] and final.text == got[1] and final.finish_reason == want[-1].finish_reason
    # the stop token ended it, after min_tokens, and is not in the text
    assert len(got[0]) > MIN_TOKENS and got[0][-1] == STOP_ID and STOP_ID not in got[0][:-1]
    assert final.finish_reason == "stop"
    assert got[1] == reference_engine.tokenizer.decode(got[0][:-1], skip_special_tokens=True)
    assert all(lp is not None and len(lp.top) == 2 for lp in got[2])

    async def again():
        async with Workers(env, reference_engine, "prefill") as w:
            return await w.redecode(decode_job, kept[decode_job.kv_key], 2)

    # Redelivered (the KV object back in the store): the same tokens again, same seqs.
    chunks2, final2 = run_sync(again())
    assert _streamed(chunks2) == (got[0][1:], got[1][len(chunks[0].text) :], got[2][1:])
    assert [c.seq for c in chunks2] == list(range(1, len(chunks)))
    assert final2.token_ids == final.token_ids and final2.text == final.text

    # Negative controls: a decode worker that drops one parameter decodes something else.
    for dropped in ({"repetition_penalty": 1.0}, {"min_tokens": 0}, {"frequency_penalty": 0.0}, {"logit_bias": ()}):

        def mutated(s, *, seed, dropped=dropped):
            return replace(sampling_params(s, seed=seed), **dropped)

        monkeypatch.setattr(decode_handler, "sampling_params", mutated)
        chunks3, _ = run_sync(again())
        assert [t for c in chunks3 for t in c.token_ids] != got[0][1:], dropped
    monkeypatch.setattr(decode_handler, "sampling_params", sampling_params)


def test_epd_completions_prompt_and_epd_pd_with_every_parameter(env, reference_engine):
    """A completions prompt (text, no chat template) through E|P|D and E|PD; chat through E|PD."""
    text = "a a a a a a a a"
    spec = SEEDED_ALL

    async def main():
        out = {}
        async with Workers(env, reference_engine, "prefill") as w:
            out["epd-text"] = await w.run(_job(_rid("c-epd"), spec, prompt=text))
            ids = tuple(reference_engine.tokenizer(text)["input_ids"])
            out["epd-ids"] = await w.run(_job(_rid("c-ids"), spec, prompt=ids))
        async with Workers(env, reference_engine, "pd") as w:
            out["pd-text"] = await w.run(_job(_rid("c-pd"), spec, prompt=text))
            out["pd-chat"] = await w.run(_job(_rid("pd-chat"), spec, messages=LOOPY))
        return out

    out = run_sync(main())
    want_raw = _want(run_sync(_aggregated(reference_engine, RawPrompt(text=text), spec)))
    want_chat = _want(run_sync(_aggregated(reference_engine, LOOPY, spec)))
    assert want_raw != want_chat  # control: the prompt matters (no chat template for completions)
    for name in ("epd-text", "epd-ids", "pd-text"):
        chunks, final, _ = out[name]
        assert _streamed(chunks) == want_raw, name
        assert final.prompt_tokens == len(reference_engine.tokenizer(text)["input_ids"]), name
    assert _streamed(out["pd-chat"][0]) == want_chat
