"""The ``epd`` command line.

epd up [--topology agg|e-pd|e-p-d]   embedded NATS + S3 + the services, serving on :8000; restarts a
                                     service that exits, stops on Ctrl-C or when NATS or S3 dies
epd model build-tiny DIR   write a deterministic random-weight model folder
epd model train-demo DIR   train the demo model (shapes questions) on CPU; the trained one ships in the repo
epd api | encoder | prefill | decode    run one service (settings from EPD_* env vars)
epd healthcheck --role ROLE    exit 0 if this container's service is healthy (compose healthchecks)
epd replay list|show|run|export|import   recorded requests: timelines, re-runs, cases (shared.tools.replay_cli)
epd ec ls|purge                          EC store per model version, purges (shared.tools.ec_cli)
epd bench run|compare   load any OpenAI-compatible endpoint with a multimodal workload; compare results
epd plan RESULT.json --rate R   worker counts per role from measured stage costs (shared.tools.bench)
epd kube render                 the Kubernetes manifests of deploy/kubernetes/ (shared.tools.kubernetes)
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import io
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from shared.tools.infra import (
    DEFAULT_NATS_PORT,
    DEFAULT_S3_PORT,
    SEAWEED_REGION,
    EmbeddedNats,
    EmbeddedS3,
    InfraError,
    PortInUseError,
    PortReservation,
    ServerTLS,
)
from shared.tools.models.demo import DEFAULT_STEPS, SHIPPED_DIR
from shared.tools.models.tiny import ARCHS, default_model_dir
from shared.topology import TOPOLOGIES, Service, Topology

if TYPE_CHECKING:
    from shared.config import EngineKind, JanitorSettings, ModelSettings, NatsSettings, StoreSettings
    from shared.nats_auth import Role
    from shared.tools.certs import Written
    from shared.tools.forkserver import ForkServer
    from shared.tools.launcher import Stack
    from shared.tools.nats_identities import NatsIdentities

DEFAULT_DATA_DIR = Path("var")


def _cmd_service(name: str):
    def run(_args: argparse.Namespace) -> int:
        import importlib

        importlib.import_module(f"services.{name}.main").main()
        return 0

    return run


def _cmd_build_tiny(args: argparse.Namespace) -> int:
    from shared.tools.models.tiny import build_tiny_model

    started = time.perf_counter()
    path = build_tiny_model(Path(args.out), arch=args.arch, size=args.size, seed=args.seed)
    print(f"wrote {args.arch}/{args.size} (seed {args.seed}) to {path} in {time.perf_counter() - started:.1f}s")
    return 0


def _cmd_train_demo(args: argparse.Namespace) -> int:
    import logging

    from shared.tools.models.demo import train_demo_model

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    started = time.perf_counter()
    path = train_demo_model(Path(args.out), seed=args.seed, steps=args.steps)
    took = time.perf_counter() - started
    print(f"trained the demo model (seed {args.seed}, {args.steps} steps) into {path} in {took:.0f}s")
    return 0


def _example_request(model_name: str, demo: bool, *, video: bool = False) -> str:
    """The body of the curl ``epd up`` prints: for the demo model a question it answers (about a
    generated image, inline; ``video``: about a generated clip, sampled at its own rate), else any
    image with a generic question."""
    extra: dict[str, object] = {}
    if demo:
        from shared.tools.models.shapes import EXAMPLE, EXAMPLE_VIDEO

        content = (EXAMPLE_VIDEO if video else EXAMPLE).content()
        if video:
            extra = {"media_io_kwargs": EXAMPLE_VIDEO.chat_request(model_name)["media_io_kwargs"]}
    else:
        from PIL import Image

        img = Image.new("RGB", (56, 56))
        img.putdata([((x * 37) % 256, (y * 53) % 256, ((x + y) * 11) % 256) for y in range(56) for x in range(56)])
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
        content = [{"type": "text", "text": "Describe this image."}, {"type": "image_url", "image_url": {"url": url}}]
    # Greedy: the answer it promises is the one a paste gets (a sampled one could differ).
    body = {
        "model": model_name,
        "max_tokens": 16,
        "temperature": 0,
        "messages": [{"role": "user", "content": content}],
        **extra,
    }
    return json.dumps(body, separators=(", ", ": "))


#: the variable the curl ``epd up`` prints reads its API key from when keys are on: the openai
#: client's (and ``epd bench run``'s) - the key itself is never printed
CLIENT_API_KEY_ENV = "OPENAI_API_KEY"
#: what ``epd up --allow-local-urls`` sets EPD_URL_ALLOW_NETWORKS to: the loopback networks
LOCAL_URL_NETWORKS = "127.0.0.0/8,::1/128"


def example_curl(url: str, body: str, *, api_keys: bool, cacert: Path | None = None) -> str:
    """The ``curl`` line ``epd up`` prints; with API keys on, its ``Authorization`` header reads
    the key from :data:`CLIENT_API_KEY_ENV` (the shell expands it; nothing secret is printed);
    ``cacert``: the CA an https ``url`` is verified against (``epd up --tls``)."""
    auth = f'-H "Authorization: Bearer ${CLIENT_API_KEY_ENV}" ' if api_keys else ""
    ca = f"--cacert {cacert} " if cacert is not None else ""
    return f"curl -s {ca}{url}/v1/chat/completions {auth}-H 'Content-Type: application/json' -d '{body}'"


def connect_exports(
    nats_url: str, s3_endpoint: str, access_key: str, secret_key: str, *, tls_ca: Path | None = None
) -> str:
    """The banner's lines that point ``epd ec`` / ``epd replay`` (and other shells) at a stack
    ``epd up`` started (``tls_ca``: NATS and S3 serve TLS, verified against it). The S3 keys are
    printed only when they are the embedded dev defaults; other keys came from the environment
    (EPD_S3_ACCESS_KEY / EPD_S3_SECRET_KEY) and are never printed."""
    from shared.config import S3_ACCESS_KEY_ENV, S3_SECRET_KEY_ENV, StoreSettings, env_var

    fields = StoreSettings.model_fields
    dev = tuple(fields[name].default.get_secret_value() for name in StoreSettings.SECRET_FIELDS)
    exports = f"export {env_var('nats_url')}={nats_url} {env_var('s3_endpoint')}={s3_endpoint}"
    if tls_ca is not None:
        exports += " " + " ".join(f"{k}={v}" for k, v in _tls_client_env(tls_ca).items())
    if (access_key, secret_key) == dev:
        return f"  {exports} {S3_ACCESS_KEY_ENV}={access_key} {S3_SECRET_KEY_ENV}={secret_key}\n"
    return (
        f"  {exports}\n"
        f"  (and {S3_ACCESS_KEY_ENV} / {S3_SECRET_KEY_ENV} as in the environment epd up was started with: "
        "not printed)\n"
    )


def _example_answer(*, video: bool = False) -> str:
    from shared.tools.models.shapes import EXAMPLE, EXAMPLE_VIDEO, describe

    if video:
        return f"{EXAMPLE_VIDEO.answer!r}: the video is {describe(EXAMPLE_VIDEO.scenes[0])}"
    return f"{EXAMPLE.answer!r}: the image is {describe(EXAMPLE.scenes[0])}"


@dataclasses.dataclass
class _UpPlan:
    """What ``epd up`` serves, read from its flags and the environment before anything starts."""

    model: ModelSettings
    store: StoreSettings
    nats: NatsSettings
    #: the EC lifecycle's (EPD_EC_TTL_S's S3 backstop is a bucket setting: epd up's admin sets it)
    janitor: JanitorSettings
    model_path: Path
    #: --engine (a value of no engine is refused with the model folder: no family it serves)
    engine: EngineKind
    #: the demo model shipped in the repo: the banner promises its answer
    demo: bool
    #: the API's keys: --api-key, else EPD_API_KEYS from the environment (the API reads it there)
    api_keys: tuple[str, ...]
    data_dir: Path
    topology: Topology
    replicas: dict[Service, int]


@dataclasses.dataclass
class _UpHeld:
    """What ``epd up`` holds so far (None: not made yet): released and stopped at the end, whatever
    step failed."""

    ports: list[PortReservation] = dataclasses.field(default_factory=list)
    nats: EmbeddedNats | None = None
    s3: EmbeddedS3 | None = None
    #: the one this run asked for: closed with its services
    fork_server: ForkServer | None = None
    stack: Stack | None = None


@dataclasses.dataclass(frozen=True)
class _UpInfra:
    """NATS and S3 as ``epd up`` started them, with the identities its services get."""

    nats: EmbeddedNats
    s3: EmbeddedS3
    identities: NatsIdentities
    #: each store role's (access key, secret key)
    s3_role_keys: dict[Role, tuple[str, str]]
    certs: Written | None


def _cmd_up(args: argparse.Namespace) -> int:
    from shared.tools.launcher import StackError, shut_down

    started = time.perf_counter()
    plan = _up_plan(args)
    if plan is None:
        return 2
    held = _UpHeld()

    def shutdown(*_: object) -> None:
        raise KeyboardInterrupt

    # Explicit for SIGINT too: a shell's background job starts with SIGINT ignored.
    signal.signal(signal.SIGTERM, shutdown)
    signal.signal(signal.SIGINT, shutdown)
    try:
        _reserve_ports(args, plan, held.ports)
        infra = _start_infra(args, plan, held)
        env = _up_env(args, plan, infra)
        service_env = _up_service_env(args, plan, infra)
        stack = _start_services(args, plan, env, service_env, held)
        print(_ready_banner(args, plan, infra, stack, elapsed=time.perf_counter() - started), flush=True)
        _supervise(stack, (infra.nats, infra.s3))
    except KeyboardInterrupt:
        print("\nstopping...", flush=True)
        return 0
    except (InfraError, StackError) as exc:
        print(f"epd up failed: {exc}", file=sys.stderr)
        return 1
    finally:
        for ports in held.ports:
            ports.release()
        # services together, then NATS, S3 and the fork server together
        shut_down(held.stack, (held.nats, held.s3), held.fork_server)


def _up_plan(args: argparse.Namespace) -> _UpPlan | None:
    """What ``epd up`` serves; None (said on stderr) for a bad setting or no model folder. Makes
    the data dir, nothing else."""
    from pydantic import ValidationError

    from shared.config import (
        ApiSettings,
        EngineKind,
        JanitorSettings,
        ModelSettings,
        NatsSettings,
        StoreSettings,
        env_var,
    )

    try:  # the settings epd up reads itself; a bad one is said now, not in a service's traceback
        model, store, api, nats_settings = ModelSettings(), StoreSettings(), ApiSettings(), NatsSettings()
        janitor = JanitorSettings()
    except ValidationError as exc:
        print(f"epd up: invalid settings in the environment: {exc}", file=sys.stderr)
        return None
    model_path = Path(args.model) if args.model else model.model_path
    if model_path is None:  # the demo model, trained here and shipped in the repo
        model_path = SHIPPED_DIR
    model_path = model_path.resolve()
    if (problem := model_folder_problem(model_path, args.engine)) is not None:
        source = "--model" if args.model else env_var("model_path")
        print(f"epd up: {source} {model_path}: {problem}", file=sys.stderr)
        return None
    data_dir = Path(args.data_dir).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    return _UpPlan(
        model=model,
        store=store,
        nats=nats_settings,
        janitor=janitor,
        model_path=model_path,
        engine=EngineKind(args.engine),
        demo=model_path == SHIPPED_DIR.resolve(),
        api_keys=tuple(args.api_key or ()) or api.api_keys,
        data_dir=data_dir,
        topology=Topology(args.topology),
        replicas={Service.ENCODER: args.encoders, Service.PREFILL: args.prefills, Service.DECODE: args.decoders},
    )


def _reserve_ports(args: argparse.Namespace, plan: _UpPlan, held: list[PortReservation]) -> None:
    """Before anything starts: a taken API port fails now, not after every worker loaded the
    model; and held (in ``held``), with the workers' /metrics ports, until the services start, so
    NATS's and S3's own port picks cannot take them."""
    from shared.tools.launcher import worker_metrics_port

    try:
        held.append(PortReservation([args.port], args.host))
    except PortInUseError as exc:
        raise PortInUseError(
            f"the API port {args.host}:{args.port} is already in use; pick another with --port", port=args.port
        ) from exc
    if args.metrics_port:
        workers = sum(plan.replicas[s] for s in TOPOLOGIES[plan.topology].worker_services)
        try:
            metrics_ports = [worker_metrics_port(args.metrics_port, i) for i in range(workers)]
            held.append(PortReservation(metrics_ports, args.host))
        except PortInUseError as exc:
            raise PortInUseError(f"worker /metrics port {exc}; pick another --metrics-port", port=exc.port) from exc


def _start_infra(args: argparse.Namespace, plan: _UpPlan, held: _UpHeld) -> _UpInfra:
    """The certificates (--tls) and identities, then NATS and S3 started (each kept in ``held`` as
    soon as it is made); the fork server asked for preloads meanwhile."""
    from shared.ec_lifecycle.janitor import set_expiration_rule
    from shared.protocol import Subjects
    from shared.store_auth import load_or_create_keys
    from shared.tools.forkserver import default_fork_server, not_forkable
    from shared.tools.nats_identities import NatsIdentities

    data_dir = plan.data_dir
    # --tls: development certificates made once under the data dir (keys mode 0600) and reused;
    # NATS, S3 and the API serve TLS with them and every client verifies against their CA.
    certs = _tls_certs(data_dir / TLS_DIR, args.host) if args.tls else None
    server_tls = {n: ServerTLS(crt, key, certs.ca_cert) for n, (crt, key) in certs.servers.items()} if certs else {}
    # One NATS identity per role (shared.nats_auth): generated once under the data dir (mode
    # 0600), the server knows only them, each service connects as its role (docs/security.md).
    identities = NatsIdentities.under(data_dir / "nats" / "identities", Subjects(plan.nats.subject_prefix))
    nats = held.nats = EmbeddedNats(
        data_dir / "nats",
        port=args.nats_port,
        extra_config=identities.server_config(),
        max_file_store=_jetstream_file_store(plan.nats, data_dir),
        tls=server_tls.get("nats"),
    )
    # One store identity per role (shared.store_auth): keys generated once under the data dir
    # (mode 0600), each allowed its role's object prefixes only; the services get their role's
    # keys, the admin's stay with epd up (it makes the bucket) and the operator's tools.
    s3_role_keys = load_or_create_keys(data_dir / "s3" / "roles")
    s3 = held.s3 = EmbeddedS3(
        data_dir / "s3",
        port=args.s3_port,
        access_key=plan.store.s3_access_key.get_secret_value(),
        secret_key=plan.store.s3_secret_key.get_secret_value(),
        tls=server_tls.get("s3"),
        role_keys=s3_role_keys,
        bucket=plan.store.s3_bucket,
        namespace=plan.store.namespace,
    )
    if args.fork_server and not not_forkable({"EPD_ENGINE": args.engine}):  # preloads while NATS and S3 start
        held.fork_server = default_fork_server(data_dir / "logs")
    nats.start()
    s3.start()
    if (days := _ec_backstop_days(plan)) is not None:  # (a bucket setting: the admin's, as the bucket's policy)
        set_expiration_rule(s3.admin_store(), f"{plan.store.namespace}/", days)
    return _UpInfra(nats=nats, s3=s3, identities=identities, s3_role_keys=s3_role_keys, certs=certs)


def _ec_backstop_days(plan: _UpPlan) -> int | None:
    """The days of EPD_EC_TTL_S's S3 lifecycle backstop (``EPD_EC_LIFECYCLE_RULE``), which ``epd up``
    sets itself as the store's admin (the API, on its role's key, may not and is told not to); None:
    no rule."""
    from shared.ec_lifecycle.janitor import expiration_days

    ttl_s, wanted = plan.janitor.ec_ttl_s, plan.janitor.ec_lifecycle_rule
    return expiration_days(ttl_s) if ttl_s is not None and wanted else None


def _up_env(args: argparse.Namespace, plan: _UpPlan, infra: _UpInfra) -> dict[str, str]:
    """The ``EPD_*`` settings every service gets."""
    from shared.config import env_var

    env = {
        "EPD_NATS_URL": infra.nats.url,
        "EPD_S3_ENDPOINT": infra.s3.endpoint,
        # (a role's key may not ask the bucket's location: the region is given)
        env_var("s3_region"): plan.store.s3_region or SEAWEED_REGION,
        "EPD_MODEL_PATH": str(plan.model_path),
        "EPD_ENGINE": args.engine,
        # (--served-model-name / --max-model-len: every service, so the API and both engines agree)
        **({"EPD_MODEL_NAME": args.served_model_name} if args.served_model_name else {}),
        **({"EPD_MAX_MODEL_LEN": str(args.max_model_len)} if args.max_model_len else {}),
        "EPD_HOST": args.host,
        # vLLM's caches, compile artefacts and IPC sockets stay in the data dir.
        "EPD_VLLM_DIR": os.environ.get("EPD_VLLM_DIR") or str(plan.data_dir / "vllm"),
        **(_tls_client_env(infra.certs.ca_cert) if infra.certs else {}),
    }
    env.update(_flag_env(args, plan.api_keys))
    if args.allow_local_urls:
        print(
            f"--allow-local-urls: image URLs on this host are fetched "
            f"({env_var('url_allow_networks')}={env[env_var('url_allow_networks')]}; a development set-up)"
        )
    return env


def _up_service_env(args: argparse.Namespace, plan: _UpPlan, infra: _UpInfra) -> dict[str, dict[str, str]]:
    """Each service's own settings: the flags' (printed), then its NATS and store identity and
    the API's certificate (never printed)."""
    from shared.config import S3_ACCESS_KEY_ENV, S3_SECRET_KEY_ENV, env_var
    from shared.nats_auth import SERVICE_ROLES

    service_env = _service_env(args, plan.topology)
    for name, values in service_env.items():
        print(f"{name}: {' '.join(f'{k}={v}' for k, v in sorted(values.items()))}")
    for name, values in infra.identities.service_env().items():  # (after the print: never shown)
        service_env[name] = {**values, **service_env.get(name, {})}
    for name, role in SERVICE_ROLES.items():  # each service's store identity (never shown)
        role_access, role_secret = infra.s3_role_keys[role]
        keys = {S3_ACCESS_KEY_ENV: role_access, S3_SECRET_KEY_ENV: role_secret}
        service_env[name] = {**keys, **service_env.get(name, {})}
    if _ec_backstop_days(plan) is not None:  # set as the admin (_start_infra); a role key may not
        api = Service.API.value
        service_env[api] = {env_var("ec_lifecycle_rule"): "0", **service_env.get(api, {})}
    if (certs := infra.certs) is not None:  # the API's certificate and key (files): for its service only
        api_tls = {
            env_var("tls_cert"): str(certs.servers["api"][0]),
            env_var("tls_key"): str(certs.servers["api"][1]),
            env_var("tls_ca"): str(certs.ca_cert),
        }
        service_env[Service.API.value] = {**api_tls, **service_env.get(Service.API.value, {})}
    return service_env


def _start_services(
    args: argparse.Namespace,
    plan: _UpPlan,
    env: dict[str, str],
    service_env: dict[str, dict[str, str]],
    held: _UpHeld,
) -> Stack:
    """The services of the topology started (the stack kept in ``held`` first) and ready; the
    ports held for them released just before."""
    from shared.config import EngineKind
    from shared.tools.launcher import Stack

    stack = held.stack = Stack(
        env=env,
        log_dir=plan.data_dir / "logs",
        topology=args.topology,
        api_port=args.port,
        replicas=plan.replicas,
        service_env=service_env,
        metrics_port_base=args.metrics_port,
        fork_server=args.fork_server,
    )
    # A vLLM engine uses every CPU it may while it starts: engines that share CPUs start sooner one
    # after another; on CPUs of their own, all at once (measured: 90 s vs 100-113 s; ``--start``).
    staggered = args.start == "staggered" or (
        args.start == "auto" and plan.engine is EngineKind.VLLM and not _own_cpus(service_env, plan.topology)
    )
    timeout = args.ready_timeout or (600.0 if plan.engine is EngineKind.VLLM else 180.0)
    print(f"starting services{' one worker service at a time' if staggered else ''}...", flush=True)
    progress = lambda line: print(line, flush=True)  # noqa: E731 - a one-line callback
    for ports in held.ports:  # the API and the workers bind them now
        ports.release()
    stack.start(staggered=staggered, timeout=timeout, progress=progress)
    stack.wait_ready(timeout=timeout, progress=progress)
    return stack


def _ready_banner(args: argparse.Namespace, plan: _UpPlan, infra: _UpInfra, stack: Stack, *, elapsed: float) -> str:
    """What ``epd up`` prints once every service is ready: where it serves, the lines that point
    the operator's tools at it, and a request to try."""
    from shared.nats_auth import Role

    https = stack.base_url.startswith("https://")
    url = api_url(args.host, args.port, https=https)
    cacert = Path(stack.api_ca) if https and stack.api_ca else None
    model_name = args.served_model_name or plan.model.model_name or plan.model_path.name
    certs, demo, api_keys = infra.certs, plan.demo, plan.api_keys
    access_key = plan.store.s3_access_key.get_secret_value()
    secret_key = plan.store.s3_secret_key.get_secret_value()

    def curl(video: bool) -> str:
        body = _example_request(model_name, demo, video=video)
        return example_curl(url, body, api_keys=bool(api_keys), cacert=cacert)

    return (
        f"\nepd-serve ready in {elapsed:.1f}s: {url}  (model {model_name}, engine {args.engine}, "
        f"topology {args.topology})\n"
        f"  NATS {infra.nats.url}   S3 {infra.s3.url}   logs {plan.data_dir / 'logs'}\n"
        + (
            f"  TLS: NATS, S3 and the API, verified against the CA {certs.ca_cert} "
            f"(development certificates in {certs.ca_cert.parent})\n"
            if certs
            else ""
        )
        + (
            f"  worker /metrics: {', '.join(f'{n} :{p}' for n, p in stack.metrics_ports.items())}\n"
            if stack.metrics_ports
            else ""
        )
        + "\nPoint epd ec / epd replay (another shell) at it:\n"
        + connect_exports(
            infra.nats.url, infra.s3.endpoint, access_key, secret_key, tls_ca=certs.ca_cert if certs else None
        )
        + infra.identities.exports(Role.ADMIN)
        + "\n"
        "Try it:\n"
        + (
            f"  (API keys are on: export {CLIENT_API_KEY_ENV}=<one of the keys> first; epd up never prints them)\n"
            if api_keys
            else ""
        )
        + f"  {curl(False)}\n"
        + (f"  (the answer is {_example_answer()})\n\n" if demo else "\n")
        + (
            "And a video (every frame: media_io_kwargs' fps is the clip's rate):\n"
            f"  {curl(True)}\n"
            f"  (the answer is {_example_answer(video=True)})\n\n"
            if demo
            else ""
        )
        + "A service that exits is restarted (with backoff); Ctrl-C stops everything."
    )


def _supervise(stack: Stack, servers: tuple[EmbeddedNats, EmbeddedS3]) -> NoReturn:
    """Like compose's `restart: unless-stopped`: a dead service is started again (its jobs are
    redelivered); only losing NATS or the store, which hold the state, ends the stack
    (:class:`StackError`). Runs until Ctrl-C (``KeyboardInterrupt``)."""
    from shared.tools.launcher import StackError, Supervisor

    supervisor = Supervisor(stack)
    while True:
        for server in servers:
            if not server.is_running():
                raise StackError(
                    f"{server.name} (pid {server.pid}) exited; stopping the stack. "
                    f"Log {server.log_path}:\n{server.log_tail(10)}"
                )
        for event in supervisor.check():
            print(event.line(), flush=True)
        time.sleep(0.5)


def model_folder_problem(path: Path, engine: str) -> str | None:
    """Why ``path`` is no model folder ``engine`` serves (None: it looks like one: a folder with a
    config.json, as in Hugging Face's layout, of a family the engine serves) - said before anything
    starts, not in a worker's traceback."""
    from shared.errors import EngineError
    from shared.families import check_family

    if not path.exists():
        return "no such folder (a model folder in Hugging Face layout, with config.json)"
    if not path.is_dir():
        return "not a folder (a model folder in Hugging Face layout, with config.json)"
    if not (path / "config.json").is_file():
        return "no config.json in it: not a model folder in Hugging Face layout"
    try:
        check_family(engine, path)
    except EngineError as exc:
        return exc.message
    return None


def _jetstream_file_store(settings: NatsSettings, data_dir: Path) -> int:
    """The embedded NATS server's JetStream file store limit: the default, or more when the streams
    reserve more (EPD_STREAM_MAX_BYTES x streams, plus 1 GiB for the key-value buckets). Says so
    when the disk under ``data_dir`` has less free than the streams may fill."""
    import shutil

    from shared.jetstream import file_store_reserved
    from shared.protocol import Subjects
    from shared.tools.infra import DEFAULT_MAX_FILE_STORE

    gib = 2**30
    reserved = file_store_reserved(settings, Subjects(settings.subject_prefix))
    free = shutil.disk_usage(data_dir).free
    if free < reserved:
        print(
            f"epd up: warning: {free / gib:.1f} GiB free under {data_dir}; the message streams may hold up to "
            f"{reserved / gib:.1f} GiB (EPD_STREAM_MAX_BYTES each): free disk or lower EPD_STREAM_MAX_BYTES",
            file=sys.stderr,
        )
    return max(DEFAULT_MAX_FILE_STORE, reserved + gib)


#: ``epd up --tls``: the folder of its certificates, under the data dir
TLS_DIR = "tls"
#: the names a certificate of ``epd certs`` is always valid for
_LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
#: wildcard listen addresses -> the loopback address a URL on this machine names instead
_WILDCARDS = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "[::1]"}


def cert_hosts(host: str) -> tuple[str, ...]:
    """The names besides the loopback ones ``epd up --tls``'s certificates must be valid for with
    ``--host host``: that address, or for a wildcard (every interface) this machine's host name,
    which other machines reach it by (a certificate cannot name 0.0.0.0)."""
    import socket

    if host in _WILDCARDS:
        return (socket.gethostname(),)
    return () if host in _LOOPBACK_NAMES else (host,)


def api_url(host: str, port: int, *, https: bool) -> str:
    """The API's URL to print for ``--host host``: a wildcard listen address is no address to
    connect to (nor a name a certificate holds), the loopback one is."""
    return f"{'https' if https else 'http'}://{_WILDCARDS.get(host, host)}:{port}"


def _tls_certs(folder: Path, host: str) -> Written:
    """``epd up --tls``'s certificates in ``folder``: made at the first start (valid for the
    loopback names and :func:`cert_hosts`), reused at the next ones (a client keeps the CA it saved)."""
    from shared.tools.certs import ensure_certs

    hosts = cert_hosts(host)
    try:
        certs, made = ensure_certs(folder, hosts=hosts)
    except ValueError as exc:
        raise InfraError(f"--tls: {exc}") from None
    print(f"--tls: {'made development certificates in' if made else 'reusing the certificates in'} {folder}")
    return certs


def _tls_client_env(ca: Path) -> dict[str, str]:
    """The settings that make a client of ``epd up --tls``'s NATS and S3 use TLS, verified against ``ca``."""
    from shared.config import env_var

    return {env_var("nats_tls_ca"): str(ca), env_var("s3_secure"): "true", env_var("s3_tls_ca"): str(ca)}


def _flag_env(args: argparse.Namespace, api_keys: tuple[str, ...]) -> dict[str, str]:
    """The ``EPD_*`` settings ``epd up``'s flags give every service (only the API reads these).
    Secrets go here, never into the per-service settings epd up prints."""
    from shared.config import env_var

    env: dict[str, str] = {}
    if api_keys:
        env[env_var("api_keys")] = ",".join(api_keys)
    if args.allow_local_urls:
        given = os.environ.get(env_var("url_allow_networks"), "")
        env[env_var("url_allow_networks")] = ",".join(n for n in (given, LOCAL_URL_NETWORKS) if n)
    return env


def _own_cpus(service_env: dict[str, dict[str, str]], topology: Topology) -> bool:
    """Whether every worker service is bound to CPUs no other worker service has."""
    from shared.cpus import parse_cpu_list
    from shared.topology import TOPOLOGIES

    seen: set[int] = set()
    for service in TOPOLOGIES[topology].worker_services:
        cpu_list = service_env.get(service.value, {}).get("EPD_CPU_CORES")
        cores = set(parse_cpu_list(cpu_list)) if cpu_list else set()
        if not cores or seen & cores:
            return False
        seen |= cores
    return True


def _service_env(args: argparse.Namespace, topology: Topology) -> dict[str, dict[str, str]]:
    """Per-service settings from ``--cores`` and ``--service-env`` (``SystemExit`` on a bad one)."""
    from shared.config import EngineKind
    from shared.cpus import available_cpus, parse_cpu_list, split_cpus
    from shared.topology import TOPOLOGIES

    workers = [s.value for s in TOPOLOGIES[topology].worker_services]
    out: dict[str, dict[str, str]] = {}
    specs = args.cores
    if specs is None and args.engine == EngineKind.VLLM and len(workers) > 1:
        # vLLM binds each engine's threads itself, every engine to the same core(s) (on 2 CPUs all
        # take CPU 0): split the CPUs between the worker services unless told otherwise.
        specs = ["auto"]
    for spec in specs or ():
        if spec == "auto":
            for name, cores in split_cpus(available_cpus(), workers).items():
                out.setdefault(name, {})["EPD_CPU_CORES"] = cores
            continue
        name, sep, cores = spec.partition("=")
        if not sep or name not in workers:
            raise SystemExit(f"--cores {spec!r}: use auto or SERVICE=LIST with SERVICE one of {', '.join(workers)}")
        try:
            parse_cpu_list(cores)
        except ValueError as exc:
            raise SystemExit(f"--cores {spec!r}: {exc}") from None
        out.setdefault(name, {})["EPD_CPU_CORES"] = cores
    services = [s.value for s in TOPOLOGIES[topology].services]
    for spec in args.service_env or ():
        name, sep, assignment = spec.partition(":")
        key, eq, value = assignment.partition("=")
        if not sep or not eq or name not in services or not key.startswith("EPD_"):
            raise SystemExit(
                f"--service-env {spec!r}: use SERVICE:EPD_NAME=VALUE with SERVICE one of {', '.join(services)}"
            )
        out.setdefault(name, {})[key] = value
    return out


def _max_model_len(value: str) -> int:
    """``--max-model-len``: an integer of at least 16 (``EPD_MAX_MODEL_LEN``'s bound)."""
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {value!r}") from None
    if n < 16:
        raise argparse.ArgumentTypeError(f"{n} is below 16 tokens")
    return n


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="epd", description="epd-serve: disaggregated EPD serving")
    parser.add_argument("--version", action="version", version=f"epd-serve {_version()}", help="print the version")
    sub = parser.add_subparsers(dest="command")
    _add_up_parser(sub)
    _add_model_parser(sub)
    for service in Service:
        sub.add_parser(service.value, help=f"run the {service} service (EPD_* env settings)").set_defaults(
            func=_cmd_service(service.value)
        )
    _add_tool_parsers(sub)
    help_without_command(parser)
    return parser


def _add_up_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``epd up``: its options in four groups, in the order its help lists them."""
    up = sub.add_parser("up", help="start embedded NATS + S3 and all services")
    for add in (_add_up_serving, _add_up_addresses, _add_up_processes, _add_up_security):
        add(up)
    up.set_defaults(func=_cmd_up)


def _add_up_serving(up: argparse.ArgumentParser) -> None:
    """``epd up``'s options of what it serves, and where it keeps its data."""
    up.add_argument("--data-dir", default=str(DEFAULT_DATA_DIR), help="project-local folder for all data (var)")
    up.add_argument("--model", help="model folder (default: EPD_MODEL_PATH, else the demo model shipped in the repo)")
    up.add_argument(
        "--served-model-name",
        help="model id served in /v1/models and expected in requests, as vLLM's flag "
        "(default: EPD_MODEL_NAME, else the folder's name)",
    )
    up.add_argument(
        "--max-model-len",
        type=_max_model_len,
        help="context length served: prompt + max_tokens of a request, in the API and both engines, as vLLM's "
        "flag (default: EPD_MAX_MODEL_LEN, else the model's max_position_embeddings; only lowers it)",
    )
    up.add_argument(
        "--engine",
        default=os.environ.get("EPD_ENGINE", "transformers"),
        help="inference engine of the workers: transformers or vllm (default: EPD_ENGINE, else transformers)",
    )
    up.add_argument(
        "--topology",
        default=Topology.E_PD.value,
        choices=[t.value for t in Topology],
        help="agg: one worker does everything; e-pd: encoders + prefill/decode workers; "
        "e-p-d: encoders + prefill workers + decode workers",
    )


def _add_up_addresses(up: argparse.ArgumentParser) -> None:
    """``epd up``'s addresses and ports."""
    up.add_argument("--host", default="127.0.0.1", help="address the API listens on (default %(default)s)")
    up.add_argument("--port", type=int, default=8000, help="port of the API (default %(default)s)")
    up.add_argument(
        "--nats-port",
        type=int,
        default=DEFAULT_NATS_PORT,
        help="port of the embedded NATS server (default %(default)s)",
    )
    up.add_argument(
        "--s3-port", type=int, default=DEFAULT_S3_PORT, help="port of the embedded S3 server (default %(default)s)"
    )


def _add_up_processes(up: argparse.ArgumentParser) -> None:
    """``epd up``'s worker processes: how many, on which CPUs, with which settings, started how."""
    up.add_argument("--encoders", type=int, default=1, help="encoder worker processes")
    up.add_argument("--prefills", type=int, default=1, help="prefill worker processes")
    up.add_argument("--decoders", type=int, default=1, help="decode worker processes (e-p-d)")
    up.add_argument(
        "--cores",
        action="append",
        metavar="SERVICE=LIST|auto",
        help="bind a worker service to CPUs (EPD_CPU_CORES), e.g. --cores encoder=0 --cores prefill=1; "
        "auto: split the CPUs between the worker services (the default with --engine vllm and "
        "more than one worker service)",
    )
    up.add_argument(
        "--service-env",
        action="append",
        metavar="SERVICE:EPD_NAME=VALUE",
        help="a setting for one service only, e.g. prefill:EPD_VLLM_KV_CACHE_GIB=2 "
        "or prefill:EPD_MAX_WAITING_JOBS=128 (repeatable)",
    )
    up.add_argument(
        "--start",
        choices=["auto", "parallel", "staggered"],
        default="auto",
        help="start worker services all at once or one after another (auto: staggered for vLLM "
        "engines that share CPUs, else all at once)",
    )
    up.add_argument(
        "--ready-timeout",
        type=float,
        default=None,
        help="seconds to wait for all services (default 180; 600 with --engine vllm)",
    )
    up.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="workers serve Prometheus /metrics on this port + 1, + 2, ... (the API serves it on --port)",
    )
    up.add_argument(
        "--fork-server",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="start and restart the services by forking them from one process that imported torch and "
        "transformers once (shared.tools.forkserver; not for --engine vllm); --no-fork-server: a plain "
        "`python -m services.<name>` each (default: on)",
    )


def _add_up_security(up: argparse.ArgumentParser) -> None:
    """``epd up``'s API keys, local URLs and TLS."""
    up.add_argument(
        "--api-key",
        action="append",
        metavar="KEY",
        help="a Bearer key the API asks for (repeatable; sets EPD_API_KEYS, which it replaces; "
        "EPD_API_KEYS in the environment keeps keys off the command line). The printed curl reads the "
        f"key from ${CLIENT_API_KEY_ENV}",
    )
    up.add_argument(
        "--allow-local-urls",
        action="store_true",
        help="development set-up: image URLs on this host (http://127.0.0.1:..., http://localhost:...) "
        f"are fetched (adds {LOCAL_URL_NETWORKS} to EPD_URL_ALLOW_NETWORKS); by default a URL that "
        "resolves to a loopback or private address is refused (400 url_not_allowed)",
    )
    up.add_argument(
        "--tls",
        action="store_true",
        help=f"TLS on every link: NATS, S3 and the API serve TLS with development certificates made at the "
        f"first start under DATA_DIR/{TLS_DIR} (a CA, keys mode 0600; reused at the next starts) and every "
        "client verifies them against that CA; the printed URL is https and the curl says --cacert. For a stack "
        "reached from other hosts (with --host) or to try TLS; the default, plaintext, is for one host on loopback",
    )


def _add_model_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``epd model build-tiny|train-demo``."""
    model = sub.add_parser("model", help="model utilities")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    tiny = model_sub.add_parser("build-tiny", help="write a deterministic random-weight model folder")
    tiny.add_argument(
        "out", nargs="?", default=str(default_model_dir(DEFAULT_DATA_DIR)), help="folder to write (default %(default)s)"
    )
    tiny.add_argument("--arch", default="qwen2_vl", choices=sorted(ARCHS), help="model architecture")
    tiny.add_argument("--size", default="tiny", choices=["tiny", "bench"], help="tiny: tests; bench: benchmarks")
    tiny.add_argument("--seed", type=int, default=0, help="seed of the random weights (default %(default)s)")
    tiny.set_defaults(func=_cmd_build_tiny)
    train = model_sub.add_parser("train-demo", help="train the demo model (questions about shapes) on CPU")
    train.add_argument(
        "out",
        nargs="?",
        default=str(DEFAULT_DATA_DIR / "models" / "qwen2-vl-shapes"),
        help="folder to write (default %(default)s)",
    )
    train.add_argument("--seed", type=int, default=0, help="training seed (default %(default)s)")
    train.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="optimizer steps (default %(default)s)")
    train.set_defaults(func=_cmd_train_demo)


def _add_tool_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The commands other modules define: ``epd healthcheck``, ``replay``, ``ec``, ``bench``,
    ``plan``, ``config``, ``certs``, ``kube``."""
    from shared import health

    check = sub.add_parser("healthcheck", help="exit 0 if the api / this worker is healthy (container healthchecks)")
    health.add_arguments(check)
    check.set_defaults(func=health.run)

    from shared.tools import replay_cli

    replay_cli.add_parser(sub)
    from shared.tools import ec_cli

    ec_cli.add_parser(sub)  # epd ec ls|purge
    from shared.tools.bench import cli as bench_cli

    bench_cli.add_parser(sub)  # epd bench run|compare
    from shared.tools.bench import plan as bench_plan

    bench_plan.add_parser(sub)  # epd plan
    from shared.tools import config_docs

    config_docs.add_parser(sub)  # epd config docs [--check]
    from shared.tools import certs

    certs.add_parser(sub)  # epd certs DIR
    from shared.tools import kubernetes

    kubernetes.add_parser(sub)  # epd kube render [--check]
    from shared.tools import config_show

    [config_sub] = [a for a in sub.choices["config"]._actions if isinstance(a, argparse._SubParsersAction)]
    config_show.add_parser(config_sub)  # epd config show


def _version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("epd-serve")
    except importlib.metadata.PackageNotFoundError:  # a checkout that was never installed
        return "unknown (not installed)"


def help_without_command(parser: argparse.ArgumentParser) -> None:
    """A command that has subcommands, run without one (``epd``, ``epd replay``), prints its help
    and exits 2 - not argparse's bare "the following arguments are required". For ``parser`` and
    every parser below it."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            action.required = False
            parser.set_defaults(func=_print_help(parser))  # a subcommand's own func replaces it
            for child in action.choices.values():
                help_without_command(child)


def _print_help(parser: argparse.ArgumentParser):
    def run(_args: argparse.Namespace) -> int:
        parser.print_help()
        return 2

    return run


#: Hugging Face's switch for its progress bars (model loading and saving), read when transformers is imported
HF_PROGRESS_BARS_OFF = "HF_HUB_DISABLE_PROGRESS_BARS"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Progress bars redraw a line with carriage returns: on a terminal only. Not one (a log file, CI),
    # or `epd up`, whose services write to log files: the bars of Hugging Face's loading and saving
    # are off (before transformers is imported; a value set by the user wins). Ours print plain
    # lines there (shared.tools.bench.runner.progress_bar).
    if args.func is _cmd_up or not sys.stderr.isatty():
        os.environ.setdefault(HF_PROGRESS_BARS_OFF, "1")
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
