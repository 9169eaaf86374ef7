"""Topology is configuration: what ``epd up --topology agg | e-pd | e-p-d`` starts, and the ``agg``
behaviour of the API (no encode jobs) and of the agg worker (encodes in process, no store, no
encoder) - in process, against the real NATS and S3 servers."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import pytest

from shared import protocol
from shared.config import ApiSettings, DecodeSettings, PrefillSettings
from shared.protocol import EncodeJob, FinalResult, GenerationJob, ImageRef, SamplingSpec, Subjects
from shared.tools import launcher
from shared.tools.cli import build_parser
from shared.tools.launcher import Stack, StackError
from shared.topology import PREFILL_SERVICE_ROLES, TOPOLOGIES, Role, Service, Topology, service_of
from tests.stackutil import data_url, engine_messages, noise_image, png_bytes, read_stream, stack_env
from tests.test_e2e_epd import reference_tokens


@pytest.mark.parametrize(
    "topology, services, role",
    [
        ("agg", ["api", "prefill"], "agg"),
        ("e-pd", ["api", "encoder", "prefill"], "pd"),
        ("e-p-d", ["api", "encoder", "prefill", "decode"], "prefill"),
    ],
)
def test_launcher_starts_each_topology_with_its_roles(monkeypatch, tmp_path, topology, services, role):
    started = []

    def fake_start(name, env, log_path, cwd=None, *, module=None, fork_server=None):
        started.append((name, env))
        return launcher.ServiceProcess(name, None, log_path)  # type: ignore[arg-type]  # a fake: no process

    monkeypatch.setattr(launcher, "start_service", fake_start)
    stack = Stack(
        env={"EPD_ROLE": "pd", "EPD_X": "1"},
        log_dir=tmp_path,
        topology=topology,
        service_env={"decode": {"EPD_MAX_BATCH_SIZE": "4"}},
    )
    stack.start()
    assert [name for name, _ in started] == services == list(TOPOLOGIES[Topology(topology)].services)
    for _name, env in started:
        assert env["EPD_TOPOLOGY"] == topology and env["EPD_X"] == "1"
        assert env["EPD_ROLE"] == role  # the topology decides the prefill role
    # The env each service gets is valid for its settings class.
    envs = dict(started)
    assert ApiSettings(**_kwargs(envs["api"])).topology == topology
    assert PrefillSettings(**_kwargs(envs["prefill"])).role == role
    if "decode" in envs:
        assert DecodeSettings(**_kwargs(envs["decode"])).max_batch_size == 4
    assert build_parser().parse_args(["up", "--topology", topology]).topology == topology


def _kwargs(env):
    known = {"EPD_TOPOLOGY", "EPD_ROLE", "EPD_MAX_BATCH_SIZE"}
    return {k[4:].lower(): v for k, v in env.items() if k in known}


def test_unknown_topology_and_role_are_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["up", "--topology", "p-d"])
    assert exc.value.code == 2 and "invalid choice: 'p-d'" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"unknown topology 'e\|p\|d'; supported: agg, e-pd, e-p-d"):
        ApiSettings(topology="e|p|d")
    with pytest.raises(ValueError, match="unknown prefill role 'decode'; supported: pd, prefill, agg"):
        PrefillSettings(role="decode")
    with pytest.raises(ValueError, match="unknown prefill role 'decode'"):  # a Role, but not the prefill service's
        PrefillSettings(role=Role.DECODE)
    with pytest.raises(StackError, match="unknown topology 'p-d'"):
        Stack(env={}, log_dir=Path("unused"), topology="p-d")
    # Controls: the known ones are accepted, as the enums (equal to their values).
    assert ApiSettings(topology="agg").topology is Topology.AGG == "agg"
    assert PrefillSettings(role="agg").role is Role.AGG == "agg"
    assert ApiSettings().topology is Topology.E_PD and PrefillSettings().role is Role.PD


def test_one_table_describes_every_topology():
    """shared.topology.TOPOLOGIES is the one table: the CLI, the settings and the launcher read it."""
    assert set(TOPOLOGIES) == set(Topology)
    assert sorted(build_parser().parse_args(["up", "--topology", t]).topology for t in Topology) == sorted(Topology)
    for topology, spec in TOPOLOGIES.items():
        assert spec.services[0] is Service.API and spec.prefill_role in PREFILL_SERVICE_ROLES, topology
        assert spec.worker_services == tuple(s for s in spec.services if s is not Service.API)
        assert service_of(spec.prefill_role) is Service.PREFILL
        assert PrefillSettings(role=spec.prefill_role.value).role is spec.prefill_role
        assert ApiSettings(topology=topology.value).topology is topology
    assert {service_of(r) for r in Role} == set(Service) - {Service.API}
    with pytest.raises(ValueError):
        service_of("pdd")
    # Only agg runs without encoder workers: the one thing the API reads from the topology.
    assert {t for t, spec in TOPOLOGIES.items() if not spec.uses_encoder} == {Topology.AGG}
    # Members format as their values (they go into env variables and log lines).
    assert f"{Role.PD}" == str(Role.PD) == "pd" and f"{Topology.E_P_D}" == "e-p-d"


def test_wait_ready_waits_for_every_worker_service_heartbeat(monkeypatch, tmp_path):
    """Heartbeats are counted by worker service (an E|P|D prefill worker beats as ``prefill``);
    without ``roles`` the stack waits for each worker service of its topology, replicas each."""
    stack = Stack(env={}, log_dir=tmp_path, topology="e-p-d", replicas={"encoder": 2})
    beats = {"encoder": 2, "prefill": 1, "decode": 1}
    monkeypatch.setattr(stack, "health", lambda: {"status": "ok", "workers": beats})
    assert stack.wait_ready(timeout=5)["workers"] == beats
    # Negative controls: one encoder short, or the prefill worker counted under its role, is not ready.
    for short in ({**beats, "encoder": 1}, {"encoder": 2, "prefill": 0, "pd": 1, "decode": 1}):
        monkeypatch.setattr(stack, "health", lambda short=short: {"status": "ok", "workers": short})
        with pytest.raises(StackError, match="not ready"):
            stack.wait_ready(timeout=0.3)


def test_split_roles_need_an_engine_that_hands_off_the_kv_cache():
    from shared.engines import check_role, engine_class
    from shared.engines.base import Engine, FeaturesThroughWorker
    from shared.errors import EngineError

    for engine in ("transformers", "vllm"):  # both hand it off (vLLM through its KV connector)
        for role in Role:
            check_role(engine_class(engine), role)

    class NoHandoff(Engine, FeaturesThroughWorker):  # an engine without a KV hand-off
        name = "onnx"

    for role in (Role.PREFILL, Role.DECODE):
        with pytest.raises(EngineError, match=f"'onnx' engine cannot run the '{role}' role"):
            check_role(NoHandoff, role)
    for role in (Role.ENCODER, Role.PD, Role.AGG):  # control: what it can run, it may
        check_role(NoHandoff, role)


# -- agg, in process ----------------------------------------------------------------------------
@pytest.fixture
def env(nats_server, s3_server, tiny_model_dir):
    env, *_ = stack_env(nats_server, s3_server, tiny_model_dir)
    return {k[4:].lower(): v for k, v in env.items()}


@pytest.mark.parametrize("topology, queued", [("agg", False), ("e-pd", True)])
def test_api_queues_encode_jobs_except_in_agg(env, topology, queued):
    from services.api.service import ApiService

    settings = ApiSettings(**env, topology=topology)

    async def main():
        service = ApiService(settings)
        await service.start()
        try:
            return await service.prepare_images("req-topology", [data_url(noise_image(91, (56, 56)))])
        finally:
            await service.stop()

    (ref,) = asyncio.run(main())
    assert ref.encode_queued is queued
    jobs = [
        m
        for _, _, m in read_stream(settings.nats.nats_url, Subjects(settings.nats.subject_prefix).stream_encode)
        if isinstance(m, EncodeJob)
    ]
    assert len(jobs) == int(queued)


def test_agg_worker_encodes_in_process(env, reference_engine):
    from services.prefill.handler import PrefillHandler
    from shared.jetstream import JetStreamPublisher, connect, ensure_topology
    from shared.media import content_hash_of
    from shared.store.factory import open_stores
    from shared.worker import Delivery, WorkerContext, settle

    settings = PrefillSettings(**env, role="agg")
    subjects = Subjects(settings.nats.subject_prefix)
    image = noise_image(92, (64, 48))
    item = content_hash_of(image)
    ec = open_stores(settings.store, ec_fingerprint=reference_engine.encoder_fingerprint, ensure_bucket=True).ec_store()
    media_key = ec.put_media(item, png_bytes(image))
    rid = f"agg-{uuid.uuid4().hex[:8]}"
    job = GenerationJob(
        request_id=rid,
        model="qwen2-vl-tiny",
        messages=engine_messages("Describe the image.", 1),
        images=(ImageRef(item_hash=item, media_key=media_key, width=64, height=48, encode_queued=False),),
        fingerprint=reference_engine.encoder_fingerprint,
        sampling=SamplingSpec(temperature=0, max_tokens=12, ignore_eos=True),
        stream=False,
        deadline=time.time() + 60,
        created_at=time.time(),
    )

    async def main():
        nc = await connect(settings.nats, name="test-agg")
        js = nc.jetstream()
        await ensure_topology(js, settings.nats, subjects)
        handler = PrefillHandler(settings, engine=reference_engine)
        await handler.setup(WorkerContext(settings, subjects, JetStreamPublisher(js), nc))
        sub = await nc.subscribe(subjects.tokens(rid))
        try:
            verdict = await settle(
                handler, Delivery(protocol.encode(job), subjects.generate_jobs, {protocol.HDR_REQUEST_ID: rid}, 1, 3)
            )
            while True:
                event = protocol.decode((await sub.next_msg(timeout=30)).data)
                if isinstance(event, FinalResult):
                    return verdict, event
        finally:
            await handler.close()
            await nc.close()

    verdict, final = asyncio.run(main())
    assert verdict.action.value == "ack"
    want = reference_tokens(reference_engine, "Describe the image.", [image])
    assert list(final.token_ids) == want
    # Negative control: another image gives other tokens, so the equality above can fail.
    assert reference_tokens(reference_engine, "Describe the image.", [noise_image(93, (64, 48))]) != want
    assert final.ec_sources == {item: "local"}
    assert not ec.exists(item)  # the baseline neither reads nor writes EC objects
