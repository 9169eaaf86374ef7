"""The settings groups (shared/config.py): each service holds only the groups it needs, every setting
still reads the variable it read before the split, and the vLLM connectors' extra config is the
store group's dump, validated back with the same model."""

from __future__ import annotations

import json
import re

import pytest

from shared import config
from shared.config import (
    ApiSettings,
    DecodeSettings,
    EncoderSettings,
    EngineSettings,
    JanitorSettings,
    MediaSettings,
    ModelSettings,
    NatsSettings,
    PrefillSettings,
    StoreSettings,
    ToolSettings,
    WorkerSettings,
)
from shared.tools import config_docs

WORKERS = (EncoderSettings, PrefillSettings, DecodeSettings)

# The EPD_* names of the configuration reference before the settings were split into groups
# (`git show d9ea4bc:.env.example`): users' deployments and docker-compose.yml set these, so they
# never change. A new setting adds its name here; a renamed one is a breaking change.
VARIABLES_BEFORE_THE_GROUPS = frozenset(
    """
    EPD_ACK_WAIT_S EPD_API_KEYS EPD_BATCH_SIZE EPD_CPU_CORES EPD_CPU_NICE EPD_DECODE_PIXEL_BUDGET EPD_DEFAULT_MAX_TOKENS
    EPD_DTYPE EPD_DUP_WINDOW_S EPD_EC_EVICT_GRACE_S EPD_EC_JANITOR_INTERVAL_S EPD_EC_LIFECYCLE_RULE
    EPD_EC_MAX_BYTES EPD_EC_MAX_OBJECTS EPD_EC_PURGE_RETIRED_AFTER_S EPD_EC_RECONCILE_INTERVAL_S
    EPD_EC_RETIRED_AFTER_S EPD_EC_TTL_S EPD_EC_USE_FLUSH_S EPD_EC_WAIT_S EPD_ENCODE_BATCH_INVARIANT
    EPD_ENCODE_JOBS_IN_FLIGHT EPD_ENCODE_PIXEL_BUDGET EPD_ENGINE EPD_FETCH_TIMEOUT_S EPD_HEALTH_FILE EPD_HOST
    EPD_KV_SWEEP_INTERVAL_S EPD_KV_TTL_S EPD_LOCAL_CACHE_BYTES EPD_LOG_FORMAT EPD_LOG_LEVEL EPD_MAX_BATCH_SIZE
    EPD_MAX_BODY_BYTES EPD_MAX_CONCURRENT_JOBS EPD_MAX_DELIVER EPD_MAX_EC_OBJECT_BYTES EPD_MAX_IMAGES_PER_REQUEST
    EPD_MAX_IMAGE_BYTES EPD_MAX_IMAGE_PIXELS EPD_MAX_KV_OBJECT_BYTES EPD_MAX_REPREFILLS EPD_MAX_TOKENS_LIMIT
    EPD_MAX_WAITING_JOBS EPD_METRICS_PORT EPD_METRICS_PUBLIC EPD_MINIO_IMAGE EPD_MODEL_DIR EPD_MODEL_NAME
    EPD_MODEL_PATH EPD_NAMESPACE EPD_NATS_IMAGE EPD_NATS_PASSWORD EPD_NATS_URL EPD_NATS_USER EPD_PORT
    EPD_REQUEST_TIMEOUT_S EPD_ROLE EPD_ROUTING EPD_ROUTING_ADVERTISED_ITEMS EPD_ROUTING_AFFINITY_TIMEOUT_S
    EPD_ROUTING_AFFINITY_WEIGHT EPD_ROUTING_LOAD_WEIGHT EPD_ROUTING_TAKEOVER_S
    EPD_S3_ACCESS_KEY EPD_S3_BUCKET EPD_S3_ENDPOINT EPD_S3_REGION
    EPD_S3_SECRET_KEY EPD_S3_SECURE EPD_STORE_BACKEND EPD_STORE_FS_ROOT EPD_STREAM_MAX_AGE_S EPD_STREAM_MAX_BYTES
    EPD_STREAM_REPLICAS EPD_SUBJECT_PREFIX EPD_TOPOLOGY EPD_TORCH_THREADS EPD_UNREACHABLE_EXIT_S
    EPD_URL_ALLOW_HOSTS EPD_URL_ALLOW_NETWORKS EPD_VLLM_DIR EPD_VLLM_ENFORCE_EAGER EPD_VLLM_ENGINE_ARGS
    EPD_VLLM_KV_CACHE_GIB EPD_VLLM_MAX_MODEL_LEN EPD_VLLM_MAX_NUM_SEQS EPD_WORKER_ID EPD_WORKER_STALE_S
    EPD_NATS_PING_INTERVAL_S EPD_NATS_MAX_OUTSTANDING_PINGS EPD_PUBLISH_RETRY_S EPD_PUBLISH_TRY_S
    EPD_VLLM_MAX_NUM_BATCHED_TOKENS
    EPD_ENCODE_STEALS EPD_ENCODE_STEAL_AFTER_S
    EPD_LONG_PROMPT_TOKENS
    EPD_MAX_MODEL_LEN EPD_ALLOWED_ORIGINS EPD_ALLOWED_METHODS EPD_ALLOWED_HEADERS EPD_ALLOW_CREDENTIALS EPD_ACCESS_LOG
    EPD_MAX_VIDEO_BYTES EPD_MAX_VIDEO_DURATION_S EPD_MAX_VIDEO_TOTAL_FRAMES EPD_MAX_VIDEO_FRAMES
    EPD_MAX_VIDEO_FRAME_PIXELS EPD_VIDEO_NUM_FRAMES EPD_VIDEO_FPS EPD_MAX_VIDEOS_PER_REQUEST EPD_VIDEO_SEGMENT_FRAMES
    EPD_DRAIN_S EPD_NATS_TLS_CA EPD_NATS_TLS_CERT EPD_NATS_TLS_KEY EPD_NO_ENCODER_AFTER_S
    EPD_S3_TLS_CA EPD_TLS_CERT EPD_TLS_KEY EPD_TLS_CA
    EPD_GENERATION_CONFIG
    """.split()
)
# docker-compose.yml's own variables (no setting of a service)
COMPOSE_ONLY = {"EPD_MODEL_DIR", "EPD_NATS_IMAGE", "EPD_MINIO_IMAGE"}


def _reference_variables() -> set[str]:
    """The EPD_* names the generated reference documents (the tables and .env.example)."""
    doc = config_docs.configuration_md()
    table = {v for line in doc.splitlines() if line.startswith("| `EPD_") for v in re.findall(r"EPD_[A-Z0-9_]+", line)}
    env = set(re.findall(r"^#? ?(EPD_[A-Z0-9_]+)=", config_docs.env_example(), re.M))
    return table | env


def _variables_read() -> set[str]:
    return {row.var for cls in (*config.SERVICE_SETTINGS.values(), ToolSettings) for row in cls.env_fields().values()}


# -- each service sees only its own groups ------------------------------------------------------------
def test_each_service_holds_only_the_groups_it_needs():
    common = {"nats": NatsSettings, "store": StoreSettings}
    assert ApiSettings.groups() == {
        **common,
        "model": ModelSettings,
        "media": MediaSettings,
        "janitor": JanitorSettings,
    }
    for cls in WORKERS:
        assert cls.groups() == {**common, "model": ModelSettings, "media": MediaSettings, "runtime": EngineSettings}
    assert ToolSettings.groups() == {**common, "janitor": JanitorSettings}

    api = set(ApiSettings.env_fields())
    assert not {n for n in api if n.startswith("vllm_")}, "the API carries no vLLM knobs"
    assert api.isdisjoint(EngineSettings.model_fields) and api.isdisjoint(("metrics_port", "health_file"))
    for cls in WORKERS:
        fields = set(cls.env_fields())
        assert fields.isdisjoint(JanitorSettings.model_fields), f"{cls.__name__} carries janitor knobs"
        assert fields.isdisjoint(("host", "port", "api_keys", "topology", "request_timeout_s")), cls.__name__
    # a service's own settings are not another's
    assert "role" in PrefillSettings.env_fields() and "role" not in DecodeSettings.env_fields()
    assert "max_batch_size" not in EncoderSettings.env_fields()


def test_a_setting_reads_epd_and_its_name_whichever_group_holds_it(monkeypatch):
    for cls in (*config.SERVICE_SETTINGS.values(), ToolSettings):
        for row in cls.env_fields().values():
            assert row.var == "EPD_" + row.name.upper()
            assert row.owner.model_config["env_prefix"] == "EPD_", row
            assert row.field.alias is None and row.field.validation_alias is None, row  # no other name
    for key in [k for k in __import__("os").environ if k.startswith("EPD_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("EPD_ENGINE", "vllm")
    for attr in ("nats", "store", "model", "media", "runtime", "janitor"):  # a group's attribute is no variable
        monkeypatch.setenv(config.env_var(attr), "not a setting")
    monkeypatch.setenv("EPD_NATS_URL", "nats://n1:4222")
    monkeypatch.setenv("EPD_S3_SECRET_KEY", "from-env")
    monkeypatch.setenv("EPD_VLLM_MAX_NUM_SEQS", "7")
    monkeypatch.setenv("EPD_EC_TTL_S", "60")
    monkeypatch.setenv("EPD_PORT", "8123")
    monkeypatch.setenv("EPD_ROLE", "agg")
    api, prefill = ApiSettings(), PrefillSettings()
    assert (api.model.engine, api.nats.nats_url, api.janitor.ec_ttl_s, api.port) == ("vllm", "nats://n1:4222", 60, 8123)
    assert api.store.s3_secret_key.get_secret_value() == "from-env"
    assert (prefill.model.engine, prefill.runtime.vllm_max_num_seqs, prefill.role) == ("vllm", 7, "agg")
    # flat keyword arguments go to their group and win over the environment; the rest stays from it
    prefill = PrefillSettings(nats_url="nats://kw:1", s3_bucket="kw", vllm_max_num_seqs=3)
    assert (prefill.nats.nats_url, prefill.store.s3_bucket, prefill.runtime.vllm_max_num_seqs) == (
        "nats://kw:1",
        "kw",
        3,
    )
    assert (prefill.store.s3_secret_key.get_secret_value(), prefill.model.engine) == ("from-env", "vllm")
    assert prefill.setting("s3_bucket") == "kw" and prefill.setting("role") == "agg"


def test_every_variable_name_is_the_one_it_was():
    """The generated reference (tables and .env.example) names exactly the variables it named before
    the split, and the services and tools together read every one of them (none lost, none renamed),
    but the retired ones (``config.RETIRED_SETTINGS``), which a worker names when it finds one set."""
    retired = frozenset(config.RETIRED_SETTINGS)
    assert retired <= VARIABLES_BEFORE_THE_GROUPS  # only a setting that existed can be retired
    assert _reference_variables() == VARIABLES_BEFORE_THE_GROUPS - retired
    assert _variables_read() == VARIABLES_BEFORE_THE_GROUPS - COMPOSE_ONLY - retired
    assert config.retired_settings_in({"EPD_BATCH_SIZE": "4", "EPD_DTYPE": "float32"}) == [
        "EPD_BATCH_SIZE is no longer read: " + config.RETIRED_SETTINGS["EPD_BATCH_SIZE"]
    ]
    assert config.retired_settings_in({"EPD_BATCH_SIZE": ""}) == []  # (empty: unset, as compose passes it)
    # Each group's variables are read by every service that holds the group.
    for cls in config.SERVICE_SETTINGS.values():
        for group in cls.groups().values():
            assert {config.env_var(n) for n in group.model_fields} <= {r.var for r in cls.env_fields().values()}


# -- the connectors' extra config -------------------------------------------------------------------
def test_connector_extra_config_is_the_store_groups_dump(monkeypatch, tmp_path):
    from shared.connectors.common import ConnectorConfig
    from shared.engines.vllm_engine import connector_extra_config

    settings = PrefillSettings(
        s3_endpoint="s3.example:9443",
        s3_bucket="b1",
        s3_secure=True,
        s3_region="eu-1",
        namespace="ns1",
        max_ec_object_bytes=1234,
        max_kv_object_bytes=5678,
        s3_access_key="AKIA-not-in-the-config",
        s3_secret_key="secret-not-in-the-config",
        worker_id="w1",
        nats_url="nats://n:1",
        subject_prefix="p1",
    )
    extra = connector_extra_config(settings)
    text = json.dumps(extra)  # vLLM logs its transfer configs: no secret may be in there
    assert "not-in-the-config" not in text
    assert {k: extra[k] for k in config.StoreSettings.model_fields if k in extra} == settings.store.connector_dump()
    parsed = ConnectorConfig.from_extra(json.loads(text))
    secrets = set(StoreSettings.SECRET_FIELDS)
    want = settings.store.model_copy(update={"store_fs_root": settings.store.store_fs_root.resolve()})
    assert parsed.store.model_dump(exclude=secrets) == want.model_dump(exclude=secrets)
    assert (parsed.producer, parsed.nats_url, parsed.subject_prefix) == ("w1", "nats://n:1", "p1")
    # Credentials travel in the env, under the names the store group's fields give them.
    monkeypatch.setenv(config.S3_ACCESS_KEY_ENV, "ak-env")
    monkeypatch.setenv(config.S3_SECRET_KEY_ENV, "sk-env")
    store = parsed.store_with_credentials()
    assert (store.s3_access_key.get_secret_value(), store.s3_secret_key.get_secret_value()) == ("ak-env", "sk-env")
    assert "sk-env" not in repr(parsed) + repr(store)
    # Parsing reads only the config, never the EPD_* environment: what it leaves out is the default.
    monkeypatch.setenv("EPD_S3_BUCKET", "from-env")
    assert ConnectorConfig.from_extra({}).store.s3_bucket == StoreSettings.model_fields["s3_bucket"].default
    # The keys hand-written configs used before the groups still mean the same settings.
    legacy = ConnectorConfig.from_extra({"endpoint": "e:1", "bucket": "b", "max_object_bytes": 99})
    assert (legacy.store.s3_endpoint, legacy.store.s3_bucket) == ("e:1", "b")
    assert legacy.store.max_ec_object_bytes == legacy.store.max_kv_object_bytes == 99
    with pytest.raises(ValueError, match="unknown ec_connector_extra_config"):
        ConnectorConfig.from_extra({"s3_access_key": "inline"})
    with pytest.raises(ValueError, match="store_fs_root is required"):
        ConnectorConfig.from_extra({"store_backend": "fs"})
    fs = ConnectorConfig.from_extra({"store_backend": "fs", "store_fs_root": str(tmp_path)})
    assert fs.ec_store("f" * 16).store.root == tmp_path  # one factory: shared.store.factory.open_stores
    # Each connector bounds its objects by its own setting of the dumped group.
    decode = DecodeSettings(
        store_backend="fs", store_fs_root=tmp_path, max_ec_object_bytes=111, max_kv_object_bytes=222
    )
    kv = ConnectorConfig.from_extra(connector_extra_config(decode), "kv_connector_extra_config").kv_store("k" * 16)
    ec = ConnectorConfig.from_extra(connector_extra_config(decode)).ec_store("e" * 16)
    assert (kv.max_object_bytes, ec.max_object_bytes, kv.store.root) == (222, 111, tmp_path)


def test_worker_settings_is_the_engines_view():
    """load_engine / options_from_settings take the worker settings (groups typed), not Any."""
    import inspect

    from shared.engines import load_engine
    from shared.engines.base import Engine

    assert inspect.signature(load_engine).parameters["settings"].annotation == "WorkerSettings"
    assert inspect.signature(Engine.options_from_settings).parameters["settings"].annotation == "WorkerSettings"
    assert issubclass(DecodeSettings, WorkerSettings) and not issubclass(ApiSettings, WorkerSettings)


def test_the_encoder_pixel_budget_follows_the_engines_steps_unless_set():
    """``EPD_ENCODE_PIXEL_BUDGET`` unset: two of the engine's encode steps (vLLM on a CPU: two
    448x448 Qwen2-VL images), the fixed bound where the engine's steps do not bound its encodes
    (transformers); set, it is taken as it is."""
    step = 256 * 28 * 28
    assert EncoderSettings().pixel_budget(step) == 2 * step == 401_408
    assert EncoderSettings().pixel_budget(None) == config.UNBOUNDED_ENCODE_PIXEL_BUDGET
    assert EncoderSettings(encode_pixel_budget=1000).pixel_budget(step) == 1000
    assert EncoderSettings(encode_pixel_budget=1000).pixel_budget(None) == 1000
