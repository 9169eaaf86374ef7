"""``epd kube render [--check]``: the Kubernetes manifests under ``deploy/kubernetes/``, generated.

The manifests are derived, like docker-compose.yml's settings and ``.env.example``, from the code:
the ConfigMap from the settings reference (``shared/config.py`` through ``shared.tools.config_docs``:
every non-secret ``EPD_*`` setting at its default, the Kubernetes connection points in place of the
compose ones), the credentials from a Secret (the ``SecretStr`` settings, the API keys and the
store's account name), each Deployment's NATS identity from its role (``shared/nats_auth.py``: the
user is the role, the password that role's key of the Secret, as each Compose service gets it), the
NATS chart's users and their permissions from the same module, the workers and their roles from the
topology table (``shared/topology.py``), the KEDA triggers from the streams and durable consumers the
workers bind (``shared/protocol.py``), and ``terminationGracePeriodSeconds`` from ``EPD_DRAIN_S``
(``config.grace_period_s``). Nothing else is needed to render them (plain Python and PyYAML), so they
render and are checked offline.

Layout (``deploy/kubernetes/``)::

    base/                   ConfigMap, the API's Service, ServiceAccount, NetworkPolicies
                            (secret.example.yaml: the Secret's keys; not applied)
    nats-values.yaml        the NATS Helm chart's values: one user per deployed role with its
                            permissions, each password read from the Secret (not applied)
    <topology>-<cpu|gpu>/   one overlay per topology and accelerator: a Deployment per role from
                            the one image, PodDisruptionBudgets, a KEDA ScaledObject per worker role

``kubectl apply -k deploy/kubernetes/e-pd-cpu`` applies base + overlay. NATS (JetStream, 3 nodes,
R3 streams) and the S3 store come from their upstream Helm charts (docs/kubernetes.md gives the
values); these manifests only point at them.

``epd plan ... --emit kubernetes DIR`` (``shared.tools.bench.plan``) writes an overlay on top of one
of these folders whose ScaledObjects carry the plan's replica bounds and thresholds
(:func:`write_plan_overlay`).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import math
import os
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from shared import config, metrics, protocol
from shared.nats_auth import SERVICE_ROLES, Role, permissions
from shared.protocol import Subjects, WorkQueue
from shared.tools.nats_identities import DEPLOYED_ROLES, PASSWORD_ENV, USER_ENV, password_variable
from shared.topology import TOPOLOGIES, Service, Topology

ROOT = Path(__file__).resolve().parents[2]
OUT_DIR = Path("deploy/kubernetes")


def _version() -> str:
    """The image tag's version: the checkout's pyproject.toml (the manifests are rendered from a
    checkout), else the installed package's (an image runs ``epd`` without the checkout)."""
    pyproject = ROOT / "pyproject.toml"
    if pyproject.is_file():
        return str(tomllib.loads(pyproject.read_text())["project"]["version"])
    return importlib.metadata.version("epd-serve")


VERSION = _version()

ACCELERATORS = ("cpu", "gpu")
#: The image of each accelerator: the Dockerfile's target ``cpu`` / ``gpu`` (docker-compose.yml's tags).
IMAGE = {"cpu": f"epd-serve:{VERSION}-cpu", "gpu": f"epd-serve:{VERSION}-cuda"}
NAMESPACE = "epd"
PART_OF = "epd-serve"
CONFIGMAP = "epd-settings"
SECRET = "epd-credentials"
SERVICE_ACCOUNT = "epd-serve"
MODEL_CLAIM = "epd-model"
MODEL_PATH = "/models/model"
HEALTH_FILE = "/tmp/epd-health.json"
API_PORT = 8000
METRICS_PORT = 9100
UID = 10001  # the image's user (Dockerfile: USER 10001:10001)
#: The API's preStop pause: the Service stops sending it new connections before it drains.
API_PRESTOP_S = 5

# Where the upstream charts' services are (docs/kubernetes.md installs them under these names in
# the same namespace): the NATS chart's client Service and headless Service (KEDA reads each
# node's monitoring port through it), the MinIO chart's S3 Service.
NATS_URL = "nats://nats:4222"
NATS_CLIENT_PORT = 4222
NATS_ROUTE_PORT = 6222
NATS_MONITOR_PORT = 8222
NATS_POD_LABELS = {"app.kubernetes.io/name": "nats"}
S3_ENDPOINT = "minio:9000"
S3_PORT = 9000
S3_POD_LABELS = {"app": "minio"}
#: NATS' account of users configured without accounts (KEDA's ``account``).
NATS_ACCOUNT = "$G"
PROMETHEUS_URL = "http://prometheus-operated.monitoring.svc:9090"
#: Namespaces (``kubernetes.io/metadata.name``) the NetworkPolicies admit: KEDA's operator (NATS
#: monitoring) and Prometheus (the workers' metrics ports).
KEDA_NAMESPACE = "keda"
PROMETHEUS_NAMESPACE = "monitoring"

# The cost signal the API exports on /metrics (services.api.scaling; every API replica exports the
# same figure, so the query takes the max): seconds of queued work per role (queued jobs of the
# role's queue, shared and routed consumers, x the live cost of a job), and the jobs themselves.
PENDING_WORK_METRIC = metrics.PENDING_WORK_METRIC
QUEUE_LAG_METRIC = metrics.QUEUE_LAG_METRIC

#: The work queue and durable consumer each worker service pulls from (shared.jetstream binds them).
#: A generating worker's own routed consumer (``prefill-routed-<token>``) is no KEDA target: the
#: cost signal counts its jobs.
WORK: dict[Service, tuple[WorkQueue, str]] = {Service(name): work for name, work in protocol.WORK_CONSUMERS.items()}

# -- the settings: ConfigMap and Secret -----------------------------------------------------------
#: Credentials: the Secret's keys. The ``SecretStr`` settings plus the API keys and the store's account
#: name (compose requires them in .env the same way). The NATS identity is not one of them: each
#: Deployment connects as its own role (:data:`NATS_IDENTITY`).
CREDENTIAL_NAMES = ("EPD_API_KEYS", "EPD_S3_ACCESS_KEY")
#: The settings of a pod's NATS identity, set per Deployment: ``EPD_NATS_USER`` = its role (a literal),
#: ``EPD_NATS_PASSWORD`` = that role's key of the Secret (:func:`nats_password_key`).
NATS_IDENTITY = (USER_ENV, PASSWORD_ENV)
#: Set per container, not in the ConfigMap (value: why).
PER_POD = {
    USER_ENV: "the Deployment's role: each role connects to NATS as its own user (its password: that role's"
    " key of the Secret)",
    "EPD_WORKER_ID": "per replica: the pod name plus a random suffix",
    "EPD_HOST": "the API's container",
    "EPD_PORT": "the API's container",
    "EPD_METRICS_PORT": "the workers' containers",
    "EPD_HEALTH_FILE": "the workers' containers",
    "EPD_ROLE": "the prefill Deployment of each topology",
    "EPD_TOPOLOGY": "the API Deployment of each topology",
    "EPD_MODEL_PATH": "the read-only model volume's mount point",
}
#: ConfigMap values that differ from shared/config.py's defaults: the cluster's connection points.
KUBE_DEFAULTS = {
    "EPD_NATS_URL": NATS_URL,
    "EPD_S3_ENDPOINT": S3_ENDPOINT,
    "EPD_STORE_BACKEND": "s3",
    "EPD_STREAM_REPLICAS": "3",
}


def secret_settings() -> list[str]:
    """The settings that come from the Secret, never from the ConfigMap (``EPD_NATS_PASSWORD`` too:
    from its role's key, :func:`nats_password_key`)."""
    from shared.tools.config_docs import SECTIONS, type_name

    secret = {config.env_var(n) for s in SECTIONS for n, f in s.fields.items() if type_name(f.annotation) == "secret"}
    return sorted(secret | set(CREDENTIAL_NAMES))


def shared_secret_keys() -> list[str]:
    """The Secret's keys a pod reads under the setting's own name (``EPD_API_KEYS``: the API only)."""
    return [var for var in secret_settings() if var not in NATS_IDENTITY]


def nats_password_key(role: Role | str) -> str:
    """The Secret's key that holds ``role``'s NATS password: Compose's variable (``NATS_ENCODER_PASSWORD``),
    also the NATS server's environment variable its configuration reads it from."""
    return password_variable(role)


def secret_keys() -> list[str]:
    """Every key of the Secret: the shared credentials, then one NATS password per deployed role
    (the services' and the operator's ``viewer`` / ``admin``, as Compose's .env)."""
    return shared_secret_keys() + [nats_password_key(role) for role in DEPLOYED_ROLES]


def nats_role(service: Service) -> Role:
    """The NATS identity ``service``'s pods connect as."""
    return SERVICE_ROLES[str(service)]


def settings_data() -> dict[str, str]:
    """The ConfigMap: every setting of the reference but the secrets and the per-pod ones, at its
    default (empty: the default of shared/config.py, which a service reads as unset)."""
    from shared.tools.config_docs import SECTIONS, env_value

    secrets = set(secret_settings())
    data: dict[str, str] = {}
    for section in SECTIONS:
        for name, field in section.fields.items():
            var = config.env_var(name)
            if var in secrets or var in PER_POD or var in data:
                continue
            data[var] = KUBE_DEFAULTS.get(var, env_value(field))
    return data


def configmap(namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": CONFIGMAP, "namespace": namespace, "labels": _labels()},
        "data": settings_data(),
    }


def secret_example(namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": SECRET, "namespace": namespace, "labels": _labels()},
        "type": "Opaque",
        "stringData": {var: "CHANGE-ME" for var in secret_keys()},
    }


# -- scaling ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Scaling:
    """One worker role's KEDA bounds and triggers."""

    min_replicas: int
    max_replicas: int
    #: ``nats-jetstream`` ``lagThreshold``: jobs (pending + taken, not acked) per replica.
    lag_threshold: int
    #: ``prometheus`` threshold on ``epd:pending_work_seconds``: seconds of queued work per replica,
    #: about the queue wait a new job sees.
    work_threshold_s: float


#: The engines' default batch: the jobs a busy worker holds (taken, not acked) when its setting is unset.
ENGINE_BATCH = 16
#: The setting that bounds the jobs one worker of a service holds at once.
IN_FLIGHT_SETTING = {
    Service.ENCODER: "EPD_ENCODE_JOBS_IN_FLIGHT",
    Service.PREFILL: "EPD_MAX_CONCURRENT_JOBS",
    Service.DECODE: "EPD_MAX_BATCH_SIZE",
}


def in_flight(service: Service) -> int:
    """Jobs a busy worker of ``service`` holds, as the ConfigMap sets it: its consumer's lag counts them
    (``num_ack_pending``) although they are being served, not waiting."""
    return int(settings_data().get(IN_FLIGHT_SETTING[service]) or ENGINE_BATCH)


#: The committed overlays' starting point (``epd plan --emit kubernetes`` writes measured ones).
#: Encoders may go to zero: a generating worker encodes an item itself when no encoder starts it
#: (encode stealing, ``EPD_ENCODE_STEALS``); the others keep one warm replica (a model load takes minutes).
DEFAULT_SCALING = {
    Service.ENCODER: Scaling(min_replicas=0, max_replicas=8, lag_threshold=24, work_threshold_s=2.0),
    Service.PREFILL: Scaling(min_replicas=1, max_replicas=8, lag_threshold=24, work_threshold_s=5.0),
    Service.DECODE: Scaling(min_replicas=1, max_replicas=8, lag_threshold=24, work_threshold_s=5.0),
}
#: ``epd plan`` role -> the worker service that plays it.
PLAN_ROLE_SERVICE = {
    "encoder": Service.ENCODER,
    "pd": Service.PREFILL,
    "prefill": Service.PREFILL,
    "agg": Service.PREFILL,
    "decode": Service.DECODE,
}


def scaling_from_plan(role: str, *, workers: int, jobs_per_s: float, wait_s: float) -> Scaling:
    """A role's bounds and thresholds from ``epd plan``'s figures: at most the planned ``workers``
    (the plan's rate is the peak it sizes for), encoders down to zero, the others to one. The work
    threshold is the queue wait the plan allows the role (``wait_s``): seconds of queued work per
    replica. The lag threshold is the jobs a busy replica holds (:func:`in_flight`) plus the jobs
    queued per replica at the planned rate with that wait (Little: ``jobs/s x wait / workers``)."""
    service = PLAN_ROLE_SERVICE[role]
    wait_s = max(wait_s, 1e-3)
    lag = in_flight(service) + max(1, math.ceil(jobs_per_s * wait_s / max(workers, 1) - 1e-9))
    return Scaling(
        min_replicas=0 if service is Service.ENCODER else 1,
        max_replicas=max(1, workers),
        lag_threshold=lag,
        work_threshold_s=float(f"{wait_s:.3g}"),
    )


# -- objects ---------------------------------------------------------------------------------------
def _labels(component: str | None = None) -> dict[str, str]:
    out = {"app.kubernetes.io/name": PART_OF, "app.kubernetes.io/part-of": PART_OF}
    if component:
        out["app.kubernetes.io/component"] = component
    return out


def _selector(component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": PART_OF, "app.kubernetes.io/component": component}


def deployment_name(service: Service) -> str:
    return f"epd-{service}"


def drain_s() -> float:
    """``EPD_DRAIN_S`` as the ConfigMap sets it (its default)."""
    return float(settings_data()["EPD_DRAIN_S"])


def _healthcheck(service: Service) -> dict[str, Any]:
    return {"exec": {"command": ["epd", "healthcheck", "--role", str(service)]}}


def _probes(service: Service, grace_s: int) -> dict[str, Any]:
    startup = 24 if service is Service.API else 60  # 2 min; workers 10 min (model load, vLLM on a GPU)
    period = 5 if service is Service.API else 10
    return {
        "startupProbe": {**_healthcheck(service), "periodSeconds": period, "timeoutSeconds": 5,
                         "failureThreshold": startup},
        "readinessProbe": {**_healthcheck(service), "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 3},
        # A liveness failure while the pod drains must not cut its drain short.
        "livenessProbe": {**_healthcheck(service), "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 6,
                          "terminationGracePeriodSeconds": grace_s},
    }  # fmt: skip


def _env(service: Service, topology: Topology, accelerator: str) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [{"name": "EPD_MODEL_PATH", "value": MODEL_PATH}]
    if service is Service.API:
        env += [
            {"name": "EPD_HOST", "value": "0.0.0.0"},
            {"name": "EPD_PORT", "value": str(API_PORT)},
            {"name": "EPD_TOPOLOGY", "value": str(topology)},
        ]
    else:
        env += [
            {"name": "EPD_METRICS_PORT", "value": str(METRICS_PORT)},
            {"name": "EPD_HEALTH_FILE", "value": HEALTH_FILE},
        ]
    if service is Service.PREFILL:
        env.append({"name": "EPD_ROLE", "value": str(TOPOLOGIES[topology].prefill_role)})
    if accelerator == "gpu":  # the API too: the engine is part of the encoder fingerprint
        env.append({"name": "EPD_ENGINE", "value": "vllm"})
    role = nats_role(service)  # its own NATS identity, as each Compose service's
    env += [
        {"name": USER_ENV, "value": role.value},
        {"name": PASSWORD_ENV, "valueFrom": {"secretKeyRef": {"name": SECRET, "key": nats_password_key(role)}}},
    ]
    for var in shared_secret_keys():
        if var == "EPD_API_KEYS" and service is not Service.API:
            continue
        env.append({"name": var, "valueFrom": {"secretKeyRef": {"name": SECRET, "key": var}}})
    return env


def _resources(service: Service, accelerator: str) -> dict[str, Any]:
    if service is Service.API:
        return {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "2Gi"}}
    if accelerator == "gpu":
        return {
            "requests": {"cpu": "4", "memory": "16Gi", "nvidia.com/gpu": 1},
            "limits": {"memory": "32Gi", "nvidia.com/gpu": 1},
        }
    return {"requests": {"cpu": "2", "memory": "4Gi"}, "limits": {"memory": "8Gi"}}


def deployment(service: Service, topology: Topology, accelerator: str, namespace: str) -> dict[str, Any]:
    grace = config.grace_period_s(drain_s()) + (API_PRESTOP_S if service is Service.API else 0)
    gpu_worker = accelerator == "gpu" and service is not Service.API
    container: dict[str, Any] = {
        "name": str(service),
        "image": IMAGE[accelerator],
        "imagePullPolicy": "IfNotPresent",
        "command": ["python", "-m", f"services.{service}"],
        "envFrom": [{"configMapRef": {"name": CONFIGMAP}}],
        "env": _env(service, topology, accelerator),
        "ports": [
            {"name": "http", "containerPort": API_PORT}
            if service is Service.API
            else {"name": "metrics", "containerPort": METRICS_PORT}
        ],
        **_probes(service, grace),
        "resources": _resources(service, accelerator),
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [
            {"name": "model", "mountPath": MODEL_PATH, "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "home", "mountPath": "/home/epd"},  # HOME: caches (vLLM, torch) of this pod only
        ]
        + ([{"name": "dshm", "mountPath": "/dev/shm"}] if gpu_worker else []),
    }
    if service is Service.API:
        container["lifecycle"] = {"preStop": {"sleep": {"seconds": API_PRESTOP_S}}}
    volumes: list[dict[str, Any]] = [
        {"name": "model", "persistentVolumeClaim": {"claimName": MODEL_CLAIM, "readOnly": True}},
        {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}},
        {"name": "home", "emptyDir": {"sizeLimit": "8Gi"}},
    ]
    if gpu_worker:  # vLLM / torch share tensors between processes through /dev/shm
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "4Gi"}})
    pod: dict[str, Any] = {
        "serviceAccountName": SERVICE_ACCOUNT,
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": grace,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": UID,
            "runAsGroup": UID,
            "fsGroup": UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": volumes,
    }
    if gpu_worker:
        pod["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    annotations = {}
    if service is not Service.API:
        annotations = {"prometheus.io/scrape": "true", "prometheus.io/port": str(METRICS_PORT)}
    spec: dict[str, Any] = {
        "selector": {"matchLabels": _selector(str(service))},
        # GPU nodes rarely have a spare GPU for a surge pod: replace one at a time instead.
        "strategy": {
            "type": "RollingUpdate",
            "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}
            if gpu_worker
            else {"maxSurge": 1, "maxUnavailable": 0},
        },
        "template": {
            "metadata": {"labels": _labels(str(service)), **({"annotations": annotations} if annotations else {})},
            "spec": pod,
        },
    }
    if service is Service.API:
        spec = {"replicas": 2, **spec}  # worker replicas belong to their ScaledObject (KEDA's HPA)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": deployment_name(service), "namespace": namespace, "labels": _labels(str(service))},
        "spec": spec,
    }


def pod_disruption_budget(service: Service, namespace: str) -> dict[str, Any]:
    budget = {"minAvailable": 1} if service is Service.API else {"maxUnavailable": 1}
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": deployment_name(service), "namespace": namespace, "labels": _labels(str(service))},
        "spec": {**budget, "selector": {"matchLabels": _selector(str(service))}},
    }


def scaled_object(service: Service, scaling: Scaling, namespace: str, prometheus_url: str) -> dict[str, Any]:
    queue, consumer = WORK[service]
    prefix = settings_data().get("EPD_SUBJECT_PREFIX") or "epd"
    monitor = f"nats-headless.{namespace}.svc.cluster.local:{NATS_MONITOR_PORT}"
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {"name": deployment_name(service), "namespace": namespace, "labels": _labels(str(service))},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": deployment_name(service)},
            "minReplicaCount": scaling.min_replicas,
            "maxReplicaCount": scaling.max_replicas,
            "pollingInterval": 15,
            "cooldownPeriod": 300,  # before the last replica goes (scale to zero)
            "advanced": {
                "horizontalPodAutoscalerConfig": {
                    "behavior": {
                        # one replica a minute after 5 min of lower demand: each leaving worker drains
                        "scaleDown": {
                            "stabilizationWindowSeconds": 300,
                            "policies": [{"type": "Pods", "value": 1, "periodSeconds": 60}],
                        }
                    }
                }
            },
            "triggers": [
                {
                    "type": "nats-jetstream",
                    "name": "queue-lag",
                    "metadata": {
                        "natsServerMonitoringEndpoint": monitor,
                        "account": NATS_ACCOUNT,
                        "stream": Subjects(prefix).work_stream(queue),
                        "consumer": consumer,
                        "lagThreshold": str(scaling.lag_threshold),
                        "activationLagThreshold": "0",
                    },
                },
                {
                    "type": "prometheus",
                    "name": "pending-work",
                    "metadata": {
                        "serverAddress": prometheus_url,
                        "query": f'max({PENDING_WORK_METRIC}{{role="{service}"}})',
                        "threshold": f"{scaling.work_threshold_s:g}",
                        "activationThreshold": "0",
                    },
                },
            ],
        },
    }


def api_service(namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": deployment_name(Service.API), "namespace": namespace, "labels": _labels("api")},
        "spec": {
            "type": "ClusterIP",  # put an Ingress or a LoadBalancer in front (TLS there)
            "selector": _selector("api"),
            "ports": [{"name": "http", "port": API_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def service_account(namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": {"name": SERVICE_ACCOUNT, "namespace": namespace, "labels": _labels()},
        "automountServiceAccountToken": False,
    }


def _ns(name: str) -> dict[str, Any]:
    return {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": name}}}


_DNS = {
    "to": [{**_ns("kube-system"), "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}],
    "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}],
}
_NATS = {"to": [{"podSelector": {"matchLabels": NATS_POD_LABELS}}], "ports": [{"protocol": "TCP", "port": 4222}]}
_S3 = {"to": [{"podSelector": {"matchLabels": S3_POD_LABELS}}], "ports": [{"protocol": "TCP", "port": S3_PORT}]}
#: The API fetches image and video URLs: public addresses only (it refuses private ones itself too).
_PUBLIC_WEB = {
    "to": [
        {
            "ipBlock": {
                "cidr": "0.0.0.0/0",
                "except": ["10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "169.254.0.0/16", "100.64.0.0/10"],
            }
        }
    ],
    "ports": [{"protocol": "TCP", "port": 80}, {"protocol": "TCP", "port": 443}],
}


def network_policies(namespace: str) -> list[dict[str, Any]]:
    """Only the API is reachable from outside; the workers reach NATS, S3 and DNS only and let
    Prometheus in on their metrics port; NATS lets epd-serve in on its client port, its own nodes
    on the route port and KEDA on the monitoring port."""

    def policy(name: str, selector: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
        return {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": name, "namespace": namespace, "labels": _labels()},
            "spec": {"podSelector": selector, **spec},
        }

    workers = [str(s) for s in WORK]
    return [
        policy(
            "epd-default-deny",
            {"matchLabels": {"app.kubernetes.io/part-of": PART_OF}},
            {"policyTypes": ["Ingress", "Egress"]},
        ),
        policy(
            "epd-api",
            {"matchLabels": _selector("api")},
            {
                "policyTypes": ["Ingress", "Egress"],
                "ingress": [{"ports": [{"protocol": "TCP", "port": API_PORT}]}],  # from anywhere
                "egress": [_DNS, _NATS, _S3, _PUBLIC_WEB],
            },
        ),
        policy(
            "epd-workers",
            {
                "matchLabels": {"app.kubernetes.io/name": PART_OF},
                "matchExpressions": [{"key": "app.kubernetes.io/component", "operator": "In", "values": workers}],
            },
            {
                "policyTypes": ["Ingress", "Egress"],
                "ingress": [
                    {"from": [_ns(PROMETHEUS_NAMESPACE)], "ports": [{"protocol": "TCP", "port": METRICS_PORT}]}
                ],
                "egress": [_DNS, _NATS, _S3],
            },
        ),
        policy(
            "epd-nats",
            {"matchLabels": NATS_POD_LABELS},
            {
                "policyTypes": ["Ingress"],
                "ingress": [
                    {
                        "from": [{"podSelector": {"matchLabels": {"app.kubernetes.io/part-of": PART_OF}}}],
                        "ports": [{"protocol": "TCP", "port": NATS_CLIENT_PORT}],
                    },
                    {
                        "from": [{"podSelector": {"matchLabels": NATS_POD_LABELS}}],
                        "ports": [{"protocol": "TCP", "port": NATS_ROUTE_PORT}],
                    },
                    {
                        "from": [_ns(KEDA_NAMESPACE), _ns(PROMETHEUS_NAMESPACE)],
                        "ports": [{"protocol": "TCP", "port": NATS_MONITOR_PORT}],
                    },
                ],
            },
        ),
    ]


# -- the NATS chart's values ------------------------------------------------------------------------
#: The NATS Helm chart's values (``helm install nats nats/nats -f deploy/kubernetes/nats-values.yaml``).
NATS_VALUES = Path("nats-values.yaml")


def nats_users(prefix: str | None = None) -> list[dict[str, Any]]:
    """One user per deployed role (``shared.tools.nats_identities.DEPLOYED_ROLES``) with its permissions
    (``shared.nats_auth``) for the ConfigMap's subject prefix; each password is the nats-server's
    environment variable (``<< $NATS_API_PASSWORD >>``: the chart writes it unquoted, nats-server reads
    the variable), which the NATS container takes from the role's key of the Secret."""
    subjects = Subjects(prefix or settings_data().get("EPD_SUBJECT_PREFIX") or "epd")
    users = []
    for role in DEPLOYED_ROLES:
        perms = permissions(role, subjects)
        publish: dict[str, list[str]] = {"allow": perms.publish}
        if perms.publish_deny:
            publish["deny"] = perms.publish_deny
        users.append(
            {
                "user": role.value,
                "password": f"<< ${password_variable(role)} >>",
                "permissions": {"publish": publish, "subscribe": {"allow": perms.subscribe}},
            }
        )
    return users


def nats_values(prefix: str | None = None) -> dict[str, Any]:
    """The NATS chart's (nats-io/k8s, chart 1.x) values: 3 nodes with JetStream, the monitoring port
    for KEDA, deploy/nats.conf's payload limit, the per-role users, and the NATS container's
    environment: every role's password from the Secret (the server checks them all)."""
    return {
        "config": {
            "cluster": {"enabled": True, "replicas": 3},
            "jetstream": {"enabled": True, "fileStore": {"pvc": {"size": "20Gi"}}},
            "monitor": {"enabled": True},
            "merge": {"max_payload": "<< 8MB >>", "authorization": {"users": nats_users(prefix)}},
        },
        "container": {
            "env": {
                password_variable(role): {
                    "valueFrom": {"secretKeyRef": {"name": SECRET, "key": nats_password_key(role)}}
                }
                for role in DEPLOYED_ROLES
            }
        },
        # its default client has no identity: the operator's tools are `epd replay` / `epd ec` as viewer / admin
        "natsBox": {"enabled": False},
    }


def secret_command(namespace: str = NAMESPACE) -> str:
    """The command that creates the Secret with random credentials (docs/kubernetes.md): every key of
    :func:`secret_keys`, ``EPD_S3_ACCESS_KEY`` the store's account name of the MinIO values."""
    fixed = {"EPD_S3_ACCESS_KEY": "epd-services"}
    shared = " ".join(
        f"--from-literal={k}={fixed[k]}" if k in fixed else f'--from-literal={k}="$(openssl rand -hex 24)"'
        for k in shared_secret_keys()
    )
    keys = " ".join(nats_password_key(role) for role in DEPLOYED_ROLES)
    loop = f'$(for k in {keys}; do echo "--from-literal=$k=$(openssl rand -hex 24)"; done)'
    return f"kubectl -n {namespace} create secret generic {SECRET} {shared} {loop}"


# -- files -----------------------------------------------------------------------------------------
HEADER = (
    "# Generated by `epd kube render` (shared/tools/kubernetes.py) from shared/config.py, shared/topology.py\n"
    "# and shared/protocol.py; do not edit by hand: overlay it (docs/kubernetes.md).\n"
)


def dump(objs: list[dict[str, Any]], note: str = "") -> str:
    body = "---\n".join(yaml.safe_dump(o, sort_keys=False, default_flow_style=False, width=120) for o in objs)
    return HEADER + (note if note else "") + body


def _kustomization(resources: list[str], namespace: str, patches: list[str] | None = None) -> str:
    doc: dict[str, Any] = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "namespace": namespace,
        "resources": resources,
    }
    if patches:
        doc["patches"] = [{"path": p} for p in patches]
    return dump([doc])


def overlay_name(topology: Topology | str, accelerator: str) -> str:
    return f"{Topology(topology)}-{accelerator}"


def worker_services(topology: Topology | str) -> list[Service]:
    return list(TOPOLOGIES[Topology(topology)].worker_services)


def render_base(namespace: str = NAMESPACE) -> dict[Path, str]:
    base = Path("base")
    return {
        base / "kustomization.yaml": _kustomization(
            ["configmap.yaml", "serviceaccount.yaml", "service.yaml", "networkpolicies.yaml"], namespace
        ),
        base / "configmap.yaml": dump(
            [configmap(namespace)],
            "# Every non-secret EPD_* setting at its default (docs/configuration.md); an empty value means the\n"
            "# default of shared/config.py. Credentials are in the Secret epd-credentials (secret.example.yaml).\n",
        ),
        base / "secret.example.yaml": dump(
            [secret_example(namespace)],
            "# NOT applied by kustomization.yaml: the keys of the Secret every pod reads its credentials from.\n"
            "# Create it yourself (kubectl create secret generic epd-credentials --from-literal=...);\n"
            "# never commit it.\n",
        ),
        base / "serviceaccount.yaml": dump([service_account(namespace)]),
        base / "service.yaml": dump([api_service(namespace)]),
        base / "networkpolicies.yaml": dump(network_policies(namespace)),
        NATS_VALUES: dump([nats_values()], NATS_VALUES_HEADER),
    }


NATS_VALUES_HEADER = (
    "# The NATS Helm chart's values (nats-io/k8s, chart 1.x; docs/kubernetes.md), NOT applied by a kustomization:\n"
    "#   helm install nats nats/nats -n epd -f deploy/kubernetes/nats-values.yaml\n"
    "# One NATS user per role (shared/nats_auth.py, subject prefix of the ConfigMap), each with only the\n"
    "# subjects its role needs; every password is the nats-server's environment variable NATS_<ROLE>_PASSWORD,\n"
    "# which the NATS container reads from the Secret epd-credentials (each epd-serve pod reads only its own).\n"
)


def render_overlay(
    topology: Topology | str,
    accelerator: str,
    *,
    scaling: dict[Service, Scaling] | None = None,
    namespace: str = NAMESPACE,
    prometheus_url: str = PROMETHEUS_URL,
) -> dict[Path, str]:
    topology = Topology(topology)
    if accelerator not in ACCELERATORS:
        raise ValueError(f"unknown accelerator {accelerator!r}: {', '.join(ACCELERATORS)}")
    scaling = {**DEFAULT_SCALING, **(scaling or {})}
    folder = Path(overlay_name(topology, accelerator))
    services = list(TOPOLOGIES[topology].services)
    workers = worker_services(topology)
    return {
        folder / "kustomization.yaml": _kustomization(
            ["../base", "deployments.yaml", "poddisruptionbudgets.yaml", "scaledobjects.yaml"], namespace
        ),
        folder / "deployments.yaml": dump([deployment(s, topology, accelerator, namespace) for s in services]),
        folder / "poddisruptionbudgets.yaml": dump([pod_disruption_budget(s, namespace) for s in services]),
        folder / "scaledobjects.yaml": dump(
            [scaled_object(s, scaling[s], namespace, prometheus_url) for s in workers],
            "# Needs KEDA (2.16): a nats-jetstream trigger on the role's consumer lag and a prometheus trigger on\n"
            "# the API's cost signal; bounds and thresholds from `epd plan ... --emit kubernetes DIR`.\n",
        ),
    }


def render_all(namespace: str = NAMESPACE, prometheus_url: str = PROMETHEUS_URL) -> dict[Path, str]:
    out = render_base(namespace)
    for topology in Topology:
        for accelerator in ACCELERATORS:
            out.update(render_overlay(topology, accelerator, namespace=namespace, prometheus_url=prometheus_url))
    return out


def write_plan_overlay(
    out: Path,
    topology: str,
    accelerator: str,
    scaling: dict[Service, Scaling],
    *,
    base: Path | None = None,
    note: str = "",
) -> list[Path]:
    """``epd plan --emit kubernetes``: ``out`` = a kustomization on top of the committed overlay
    ``base`` (default: this checkout's ``deploy/kubernetes/<topology>-<accelerator>``) whose
    ScaledObject patches carry ``scaling`` (whole objects: KEDA's lists are replaced, not merged)."""
    base = base or ROOT / OUT_DIR / overlay_name(topology, accelerator)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    patches = []
    for service in worker_services(topology):
        name = f"scaledobject-{service}.yaml"
        obj = scaled_object(service, {**DEFAULT_SCALING, **scaling}[service], NAMESPACE, PROMETHEUS_URL)
        (out / name).write_text(dump([obj], note))
        patches.append(name)
        written.append(out / name)
    rel = os.path.relpath(base.resolve(), out.resolve())
    (out / "kustomization.yaml").write_text(_kustomization([rel], NAMESPACE, patches))
    return [out / "kustomization.yaml", *written]


def stale_files(root: Path = ROOT, files: dict[Path, str] | None = None) -> list[Path]:
    """The rendered files whose copy under ``root/deploy/kubernetes`` differs (or is missing)."""
    files = render_all() if files is None else files
    return [rel for rel, text in files.items() if _read(root / OUT_DIR / rel) != text]


def _read(path: Path) -> str | None:
    return path.read_text() if path.is_file() else None


def _cmd_render(args: argparse.Namespace) -> int:
    root = Path(args.root)
    kw = {"namespace": args.namespace, "prometheus_url": args.prometheus_url}
    if args.topology or args.accelerator:
        files = render_base(args.namespace)
        for t in [args.topology] if args.topology else [t.value for t in Topology]:
            for a in [args.accelerator] if args.accelerator else list(ACCELERATORS):
                files.update(render_overlay(t, a, **kw))
    else:
        files = render_all(**kw)
    out = Path(args.out) if args.out else root / OUT_DIR
    if args.check:
        stale = [rel for rel, text in files.items() if _read(out / rel) != text]
        for rel in stale:
            print(f"epd kube render: {out / rel} is stale: regenerate it with `epd kube render`", file=sys.stderr)
        return 1 if stale else 0
    for rel, text in files.items():
        path = out / rel
        if _read(path) != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path}")
    return 0


def add_parser(sub: Any) -> None:
    """Add ``kube render`` to the ``epd`` parser."""
    kube = sub.add_parser("kube", help="Kubernetes manifests (deploy/kubernetes/, docs/kubernetes.md)")
    ksub = kube.add_subparsers(dest="kube_command", required=True)
    r = ksub.add_parser("render", help="write the base and the overlays of deploy/kubernetes/ from the code")
    r.add_argument("--topology", choices=[t.value for t in Topology], help="this overlay only (default: all)")
    r.add_argument("--accelerator", choices=ACCELERATORS, help="this accelerator only (default: both)")
    r.add_argument("--out", help="folder to write (default: deploy/kubernetes of this checkout)")
    r.add_argument("--namespace", default=NAMESPACE, help="namespace of the objects (default %(default)s)")
    r.add_argument("--prometheus-url", default=PROMETHEUS_URL, help="Prometheus KEDA queries (default %(default)s)")
    r.add_argument("--check", action="store_true", help="write nothing; exit 1 naming each stale file")
    r.add_argument("--root", default=str(ROOT), help="repository root (default: this checkout)")
    r.set_defaults(func=_cmd_render)
