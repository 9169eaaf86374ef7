"""Offline checks of the Kubernetes manifests (deploy/kubernetes/, `epd plan --emit kubernetes`).

No cluster runs here, so the manifests are read the way the API server and kustomize would:

* :func:`kustomize` follows a kustomization's ``resources`` (files and folders) and its ``patches``
  (whole-object merges, lists replaced: what a strategic merge patch does to a custom resource);
* :func:`schema_problems` validates each object against pinned schemas: Kubernetes' own OpenAPI
  schemas of :data:`K8S_VERSION` through ``kubernetes-validate`` in strict mode (an unknown field is
  an error, as ``kubectl apply --validate=strict``), and ScaledObjects against the CRD vendored from
  KEDA :data:`KEDA_VERSION`, with unknown fields refused the same way;
* :func:`policy_problems` checks what a schema cannot: non-root, pinned images, probes through
  ``epd healthcheck``, credentials only from the Secret, no secret in a ConfigMap, grace >= drain,
  read-only model volumes, resources, PodDisruptionBudgets, NetworkPolicies, and a ScaledObject per
  worker role naming a stream and durable consumer the workers really bind (``shared.jetstream``);
* :func:`nats_identity_problems` checks that each pod connects to NATS as its own role (the user is the
  role, the password that role's key of the Secret, no shared account), :func:`secret_problems` the
  Secret's keys and :func:`nats_values_problems` the NATS chart's users (deploy/kubernetes/nats-values.yaml).

Each ``*_problems`` function returns human-readable problems (empty = fine), so a test can show that
a deliberately broken copy is rejected.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

from shared import config
from shared.config import NatsSettings
from shared.jetstream import consumer_configs
from shared.nats_auth import SERVICE_ROLES, permissions
from shared.protocol import Subjects
from shared.tools import kubernetes as kube
from shared.tools.nats_identities import DEPLOYED_ROLES, PASSWORD_ENV, USER_ENV, password_variable

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / kube.OUT_DIR
#: The Kubernetes minor the manifests are validated against (kubernetes-validate bundles its schemas).
K8S_VERSION = "1.31"
KEDA_VERSION = "2.16.1"
KEDA_CRD = ROOT / "tests" / "data" / f"keda-{KEDA_VERSION}" / "keda.sh_scaledobjects.yaml"
WORKER_COMPONENTS = {"encoder", "prefill", "decode"}
#: ConfigMap keys that look like a credential (besides the settings shared.tools.kubernetes puts in the
#: Secret): EPD_MAX_TOKENS_LIMIT or EPD_ALLOW_CREDENTIALS are not.
SECRET_LOOKING = re.compile(r"PASSWORD|PASSWD|SECRET|(^|_)TOKEN$|API_KEYS?$|ACCESS_KEY|PRIVATE_KEY", re.I)


# -- reading --------------------------------------------------------------------------------------
def load(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _merge(base: Any, patch: Any) -> Any:
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            out[k] = _merge(base.get(k), v) if k in base else copy.deepcopy(v)
        return out
    return copy.deepcopy(patch)


def key(obj: dict[str, Any]) -> tuple[str, str]:
    return obj.get("kind", "?"), (obj.get("metadata") or {}).get("name", "?")


def kustomize(folder: Path) -> list[dict[str, Any]]:
    """The objects ``kubectl apply -k folder`` would apply (resources, then patches)."""
    kust = load(folder / "kustomization.yaml")[0]
    objs: list[dict[str, Any]] = []
    for res in kust.get("resources", []):
        path = (folder / res).resolve()
        objs += kustomize(path) if path.is_dir() else load(path)
    for patch in kust.get("patches", []):
        for p in load(folder / patch["path"]):
            matches = [i for i, o in enumerate(objs) if key(o) == key(p)]
            if not matches:
                raise ValueError(f"{folder}: patch {patch['path']} matches no object {key(p)}")
            for i in matches:
                objs[i] = _merge(objs[i], p)
    ns = kust.get("namespace")
    if ns:
        for o in objs:
            o.setdefault("metadata", {})["namespace"] = ns
    return objs


def overlays(root: Path = DEPLOY) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir() and (p / "kustomization.yaml").is_file() and p.name != "base")


# -- schemas --------------------------------------------------------------------------------------
def _strict(schema: Any) -> Any:
    """The CRD schema with unknown fields refused (the API server prunes them silently; kubectl's
    strict field validation refuses them): every object schema with properties gets
    ``additionalProperties: false`` unless it says otherwise."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if out.get("type") == "object" and "properties" in out and "additionalProperties" not in out:
            if not out.get("x-kubernetes-preserve-unknown-fields"):
                out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def keda_schema(path: Path = KEDA_CRD) -> dict[str, Any]:
    crd = load(path)[0]
    [version] = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    return _strict(version["schema"]["openAPIV3Schema"])


_KEDA: dict[str, Any] = {}


def schema_problems(obj: dict[str, Any], version: str = K8S_VERSION) -> list[str]:
    kind, name = key(obj)
    where = f"{kind}/{name}"
    if obj.get("apiVersion", "").startswith("kustomize.config.k8s.io/"):
        return []
    if obj.get("apiVersion") == "keda.sh/v1alpha1" and kind == "ScaledObject":
        if not _KEDA:
            _KEDA["schema"] = keda_schema()
        validator = jsonschema.Draft7Validator(_KEDA["schema"])
        return [
            f"{where}: KEDA {KEDA_VERSION} schema: {'.'.join(map(str, e.path)) or '(root)'}: {e.message}"
            for e in validator.iter_errors(obj)
        ]
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{where}: Kubernetes {version} schema: {'.'.join(map(str, e.path)) or '(root)'}: {e.message}"]
    except kubernetes_validate.SchemaNotFoundError as e:
        return [f"{where}: {e.message}"]
    return []


# -- policies -------------------------------------------------------------------------------------
def _by_kind(objs: Iterable[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o.get("kind") == kind]


def _component(obj: dict[str, Any]) -> str:
    return (obj.get("metadata") or {}).get("labels", {}).get("app.kubernetes.io/component", "")


def _pod(dep: dict[str, Any]) -> dict[str, Any]:
    return dep["spec"]["template"]["spec"]


def _env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env") or []}


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels and In / NotIn / Exists / DoesNotExist) against pod labels."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        k, op, values = expr["key"], expr["operator"], expr.get("values") or []
        ok = {
            "In": labels.get(k) in values,
            "NotIn": labels.get(k) not in values,
            "Exists": k in labels,
            "DoesNotExist": k not in labels,
        }[op]
        if not ok:
            return False
    return True


def drain_of(container: dict[str, Any], objs: list[dict[str, Any]]) -> float:
    """EPD_DRAIN_S as the container sees it: its own env, else the ConfigMaps it reads, else the
    default of shared/config.py."""
    own = _env(container).get("EPD_DRAIN_S")
    if own is not None and own.get("value"):
        return float(own["value"])
    maps = {o["metadata"]["name"]: o.get("data") or {} for o in _by_kind(objs, "ConfigMap")}
    value = None
    for src in container.get("envFrom") or []:  # later sources win, as in Kubernetes
        ref = (src.get("configMapRef") or {}).get("name")
        if ref in maps and maps[ref].get("EPD_DRAIN_S"):
            value = maps[ref]["EPD_DRAIN_S"]
    return float(value) if value is not None else float(config.ServiceSettings.model_fields["drain_s"].default)


def consumers(objs: list[dict[str, Any]]) -> dict[str, set[str]]:
    """Stream -> the durable consumers the workers bind (shared.jetstream), for the deployment's
    subject prefix (the ConfigMap's EPD_SUBJECT_PREFIX)."""
    prefix = "epd"
    for cm in _by_kind(objs, "ConfigMap"):
        prefix = (cm.get("data") or {}).get("EPD_SUBJECT_PREFIX") or prefix
    out: dict[str, set[str]] = {}
    for stream, cfg in consumer_configs(NatsSettings(), Subjects(prefix)).items():
        out.setdefault(stream, set()).add(str(cfg.durable_name))
    return out


def policy_problems(objs: list[dict[str, Any]]) -> list[str]:
    problems: list[str] = []
    deployments = _by_kind(objs, "Deployment")
    secret_vars = set(kube.secret_settings())

    for cm in _by_kind(objs, "ConfigMap"):
        for k in (cm.get("data") or {}) | (cm.get("binaryData") or {}):
            if k in secret_vars or SECRET_LOOKING.search(k):
                problems.append(f"ConfigMap/{cm['metadata']['name']}: {k} is a secret (it belongs in a Secret)")

    for dep in deployments:
        name, comp = dep["metadata"]["name"], _component(dep)
        pod = _pod(dep)
        psc = pod.get("securityContext") or {}
        grace = pod.get("terminationGracePeriodSeconds", 30)
        volumes = {v["name"]: v for v in pod.get("volumes") or []}
        if pod.get("automountServiceAccountToken") is not False:
            problems.append(f"{name}: mounts a service account token (the services never call the Kubernetes API)")
        for c in pod.get("containers", []):
            where = f"{name}/{c['name']}"
            csc = c.get("securityContext") or {}
            non_root = csc.get("runAsNonRoot", psc.get("runAsNonRoot"))
            uid = csc.get("runAsUser", psc.get("runAsUser"))
            if non_root is not True or uid in (0, None):
                problems.append(f"{where}: not non-root (runAsNonRoot={non_root}, runAsUser={uid})")
            if csc.get("allowPrivilegeEscalation") is not False or csc.get("privileged"):
                problems.append(f"{where}: privilege escalation allowed")
            if "ALL" not in ((csc.get("capabilities") or {}).get("drop") or []):
                problems.append(f"{where}: capabilities not dropped")
            if csc.get("readOnlyRootFilesystem") is not True:
                problems.append(f"{where}: writable root filesystem")
            image = c.get("image", "")
            tag = image.rsplit(":", 1)[1] if ":" in image.rsplit("/", 1)[-1] else ""
            if "@sha256:" not in image and (not tag or tag == "latest"):
                problems.append(f"{where}: image {image!r} is not pinned (no tag, or :latest)")
            want = ["epd", "healthcheck", "--role", comp]
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                cmd = ((c.get(probe) or {}).get("exec") or {}).get("command")
                if cmd != want:
                    problems.append(f"{where}: {probe} is {cmd}, not `{' '.join(want)}`")
            env = _env(c)
            if comp in WORKER_COMPONENTS and not (env.get("EPD_HEALTH_FILE") or {}).get("value", "").startswith("/"):
                problems.append(f"{where}: worker without an absolute EPD_HEALTH_FILE (its probes would fail)")
            for var, e in env.items():
                if var in secret_vars and "secretKeyRef" not in (e.get("valueFrom") or {}):
                    problems.append(f"{where}: {var} does not come from a Secret")
            drain = drain_of(c, objs)
            prestop = (((c.get("lifecycle") or {}).get("preStop") or {}).get("sleep") or {}).get("seconds", 0)
            need = config.grace_period_s(drain) + prestop
            if grace < need:
                problems.append(
                    f"{name}: terminationGracePeriodSeconds {grace} < EPD_DRAIN_S {drain:g} s + "
                    f"{config.GRACE_MARGIN_S} s{f' + preStop {prestop} s' if prestop else ''} = {need}"
                )
            live = (c.get("livenessProbe") or {}).get("terminationGracePeriodSeconds")
            if live is not None and live < need:
                problems.append(f"{where}: livenessProbe.terminationGracePeriodSeconds {live} < {need}")
            res = c.get("resources") or {}
            if not {"cpu", "memory"} <= set(res.get("requests") or {}) or "memory" not in (res.get("limits") or {}):
                problems.append(f"{where}: no cpu/memory requests and memory limit")
            for m in c.get("volumeMounts") or []:
                vol = volumes.get(m["name"]) or {}
                if m["mountPath"] == kube.MODEL_PATH and not (
                    m.get("readOnly") and (vol.get("persistentVolumeClaim") or {}).get("readOnly", True)
                ):
                    problems.append(f"{where}: model volume {m['name']} is writable")
        pdbs = [
            p
            for p in _by_kind(objs, "PodDisruptionBudget")
            if _selects(p["spec"].get("selector") or {}, dep["spec"]["template"]["metadata"]["labels"])
        ]
        if len(pdbs) != 1:
            problems.append(f"{name}: {len(pdbs)} PodDisruptionBudgets select its pods (want 1)")

    problems += _scaledobject_problems(objs, deployments)
    problems += _network_problems(objs, deployments)
    problems += nats_identity_problems(objs)
    return problems


# -- NATS identities ------------------------------------------------------------------------------
#: The Secret's keys of the one account every pod used to share: no manifest may read them.
SHARED_NATS_KEYS = (USER_ENV, PASSWORD_ENV)
#: The role of each deployed role's password key (``NATS_ENCODER_PASSWORD`` -> ``encoder``).
PASSWORD_KEYS = {password_variable(role): role.value for role in DEPLOYED_ROLES}


def _pod_templates(obj: dict[str, Any]) -> list[dict[str, Any]]:
    """The pod specs of a workload (a Pod, a Job, a CronJob, a Deployment, ...); none for other kinds."""
    kind, spec = obj.get("kind"), obj.get("spec") or {}
    if kind == "Pod":
        return [spec]
    if kind == "CronJob":
        spec = (spec.get("jobTemplate") or {}).get("spec") or {}
    template = (spec.get("template") or {}).get("spec")
    return [template] if isinstance(template, dict) else []


def nats_identity_problems(objs: list[dict[str, Any]]) -> list[str]:
    """Every container connects to NATS as its own role, as each Compose service does: an epd-serve
    Deployment's ``EPD_NATS_USER`` is its role (a literal: the Secret no longer holds a shared user)
    and its ``EPD_NATS_PASSWORD`` that role's key of the Secret (``NATS_<ROLE>_PASSWORD``); any other
    workload (a Job, an init container) that connects names a deployed role and takes that role's key.
    No container reads the old shared keys (``EPD_NATS_USER`` / ``EPD_NATS_PASSWORD``), another role's
    password, or the whole Secret (``envFrom``: every role's password)."""
    problems = []
    for obj in objs:
        kind, name = key(obj)
        component = _component(obj) if kind == "Deployment" else ""
        for pod in _pod_templates(obj):
            for c in (pod.get("initContainers") or []) + (pod.get("containers") or []):
                where = f"{kind}/{name}/{c.get('name')}"
                env = _env(c)
                for src in c.get("envFrom") or []:
                    ref = (src.get("secretRef") or {}).get("name")
                    if ref == kube.SECRET:
                        problems.append(f"{where}: reads the whole Secret {ref} (envFrom: every role's NATS password)")
                refs = {
                    var: (e.get("valueFrom") or {}).get("secretKeyRef") or {}
                    for var, e in env.items()
                    if (e.get("valueFrom") or {}).get("secretKeyRef")
                }
                for var, ref in refs.items():
                    if ref.get("key") in SHARED_NATS_KEYS:
                        problems.append(
                            f"{where}: {var} reads the shared key {ref.get('key')} of Secret {ref.get('name')}"
                            " (one NATS account for every role)"
                        )
                role = SERVICE_ROLES[component].value if component in SERVICE_ROLES else None
                user = env.get(USER_ENV)
                if role is None and user is None and PASSWORD_ENV not in env:  # no NATS client
                    given = sorted({str(r.get("key")) for r in refs.values() if r.get("key") in PASSWORD_KEYS})
                    if given:
                        problems.append(f"{where}: is handed NATS passwords {given} without connecting as a role")
                    continue
                if user is None:
                    literal = None
                elif "valueFrom" in user:
                    literal = "(from " + ", ".join(f"{k} {v}" for k, v in sorted(user["valueFrom"].items())) + ")"
                else:
                    literal = user.get("value")
                if role is None:  # another workload (a Job, ...): it connects as some deployed role
                    if literal is None or literal not in PASSWORD_KEYS.values():
                        problems.append(f"{where}: EPD_NATS_USER={literal!r} is no deployed NATS role")
                        continue
                    role = literal
                elif literal != role:
                    problems.append(f"{where}: EPD_NATS_USER={literal!r}, expected its role {role!r} (a literal)")
                want = {"name": kube.SECRET, "key": password_variable(role)}
                got = refs.get(PASSWORD_ENV)
                if got is None or {k: got.get(k) for k in want} != want or got.get("optional"):
                    problems.append(
                        f"{where}: EPD_NATS_PASSWORD reads {got or env.get(PASSWORD_ENV)}, not its role's key "
                        f"{want['key']} of Secret {want['name']}"
                    )
                keys = {str(r.get("key")) for r in refs.values() if r.get("key") in PASSWORD_KEYS}
                others = sorted(keys - {want["key"]})
                if others:
                    problems.append(f"{where}: is handed other roles' NATS passwords {others}")
    return problems


def secret_problems(secret: dict[str, Any]) -> list[str]:
    """The Secret (secret.example.yaml) holds one NATS password per deployed role and no shared account."""
    keys = set(secret.get("stringData") or {}) | set(secret.get("data") or {})
    problems = [f"Secret: no key {k} (role {r}'s NATS password)" for k, r in PASSWORD_KEYS.items() if k not in keys]
    problems += [f"Secret: key {k} is the old shared NATS account" for k in SHARED_NATS_KEYS if k in keys]
    return problems


def nats_values_problems(values: dict[str, Any], prefix: str = "epd") -> list[str]:
    """The NATS chart's values: one user per deployed role, with that role's permissions of
    shared/nats_auth.py, its password the server's variable NATS_<ROLE>_PASSWORD, which the NATS
    container reads from that role's key of the Secret; no other user (a shared account)."""
    problems = []
    merge = ((values.get("config") or {}).get("merge")) or {}
    auth = merge.get("authorization") or {}
    if set(auth) - {"users", "timeout"}:
        problems.append(f"authorization: {sorted(set(auth) - {'users', 'timeout'})} besides the per-role users")
    users = {str(u.get("user")): u for u in auth.get("users") or []}
    want = {role.value: password_variable(role) for role in DEPLOYED_ROLES}
    if sorted(users) != sorted(want):
        problems.append(f"NATS users {sorted(users)}, expected one per deployed role {sorted(want)}")
    subjects = Subjects(prefix)
    for user, var in want.items():
        entry = users.get(user)
        if entry is None:
            continue
        if entry.get("password") != f"<< ${var} >>":
            problems.append(f"user {user}: password {entry.get('password')!r}, not << ${var} >>")
        perms = permissions(user, subjects)
        publish = {"allow": perms.publish, **({"deny": perms.publish_deny} if perms.publish_deny else {})}
        expected = {"publish": publish, "subscribe": {"allow": perms.subscribe}}
        if entry.get("permissions") != expected:
            problems.append(f"user {user}: permissions differ from shared/nats_auth.py's {user} role")
    env = (values.get("container") or {}).get("env") or {}
    for var in want.values():
        entry = env.get(var)
        ref = ((entry.get("valueFrom") or {}).get("secretKeyRef") or {}) if isinstance(entry, dict) else {}
        if ref != {"name": kube.SECRET, "key": var}:
            problems.append(f"NATS container: {var} is {env.get(var)!r}, not key {var} of Secret {kube.SECRET}")
    return problems


def _scaledobject_problems(objs: list[dict[str, Any]], deployments: list[dict[str, Any]]) -> list[str]:
    problems = []
    names = {d["metadata"]["name"]: d for d in deployments}
    sos = _by_kind(objs, "ScaledObject")
    known = consumers(objs)
    for dep in deployments:
        comp = _component(dep)
        if comp not in WORKER_COMPONENTS:
            continue
        targeting = [s for s in sos if s["spec"]["scaleTargetRef"]["name"] == dep["metadata"]["name"]]
        if len(targeting) != 1:
            problems.append(f"{dep['metadata']['name']}: {len(targeting)} ScaledObjects scale it (want 1)")
    for so in sos:
        where = f"ScaledObject/{so['metadata']['name']}"
        ref = so["spec"]["scaleTargetRef"]
        dep = names.get(ref["name"])
        if dep is None or ref.get("kind", "Deployment") != "Deployment":
            problems.append(
                f"{where}: scales {ref.get('kind', 'Deployment')}/{ref['name']}, which is no Deployment here"
            )
            continue
        comp = _component(dep)
        if comp not in WORKER_COMPONENTS:
            problems.append(f"{where}: scales {ref['name']}, which is no worker")
            continue
        lo, hi = so["spec"].get("minReplicaCount", 0), so["spec"].get("maxReplicaCount", 100)
        if not 0 <= lo <= hi or hi < 1:
            problems.append(f"{where}: replica bounds {lo}..{hi}")
        queue, consumer = kube.WORK[kube.Service(comp)]
        triggers = so["spec"].get("triggers") or []
        js = [t for t in triggers if t.get("type") == "nats-jetstream"]
        if len(js) != 1:
            problems.append(f"{where}: {len(js)} nats-jetstream triggers (want 1)")
        for t in js:
            md = t.get("metadata") or {}
            stream, name = md.get("stream"), md.get("consumer")
            if name not in known.get(stream, set()):
                problems.append(
                    f"{where}: consumer {name!r} of stream {stream!r} is no consumer the workers bind {known}"
                )
            elif name != consumer:
                problems.append(f"{where}: scales {comp} on consumer {name!r}, which {comp} workers do not pull")
        prom = [t for t in triggers if t.get("type") == "prometheus"]
        want = f'{{role="{comp}"}}'
        if not any(kube.PENDING_WORK_METRIC in (t.get("metadata") or {}).get("query", "") for t in prom) or not all(
            want in (t.get("metadata") or {}).get("query", "") for t in prom
        ):
            problems.append(f"{where}: no prometheus trigger on {kube.PENDING_WORK_METRIC}{want}")
        if lo == 0 and comp != "encoder":
            problems.append(f"{where}: {comp} scales to zero (only encoders may: the others load a model to serve)")
    return problems


def _network_problems(objs: list[dict[str, Any]], deployments: list[dict[str, Any]]) -> list[str]:
    problems = []
    policies = _by_kind(objs, "NetworkPolicy")
    for dep in deployments:
        labels = dep["spec"]["template"]["metadata"]["labels"]
        comp = _component(dep)
        mine = [p for p in policies if _selects(p["spec"]["podSelector"], labels)]
        name = dep["metadata"]["name"]
        for kind in ("Ingress", "Egress"):
            if not any(kind in p["spec"].get("policyTypes", []) for p in mine):
                problems.append(f"{name}: no NetworkPolicy restricts its {kind.lower()}")
        for p in mine:
            for rule in p["spec"].get("ingress") or []:
                if not rule.get("from") and comp != "api":
                    problems.append(f"NetworkPolicy/{p['metadata']['name']}: {name} is reachable from anywhere")
            if comp in WORKER_COMPONENTS:
                for rule in p["spec"].get("egress") or []:
                    if any("ipBlock" in peer for peer in rule.get("to") or []) or not rule.get("to"):
                        problems.append(f"NetworkPolicy/{p['metadata']['name']}: {name} may reach any address")
    return problems


def tree_problems(folder: Path) -> list[str]:
    """Schema and policy problems of one overlay as kustomize would apply it."""
    objs = kustomize(folder)
    out = [p for o in objs for p in schema_problems(o)]
    return out + policy_problems(objs)
