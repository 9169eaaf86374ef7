"""docs/configuration.md and .env.example are what `epd config docs` generates from shared/config.py."""

from __future__ import annotations

import shutil
from pathlib import Path

from shared.store_auth import compose_minio_policies
from shared.tools import config_docs
from shared.tools.cli import main
from shared.tools.nats_identities import COMPOSE_NATS_AUTH, SECURITY_DOC

ROOT = config_docs.ROOT


def _copy(tmp_path: Path) -> Path:
    for rel in (
        config_docs.CONFIG_DOC,
        config_docs.ENV_EXAMPLE,
        config_docs.COMPOSE_FILE,
        SECURITY_DOC,
        COMPOSE_NATS_AUTH,
        *compose_minio_policies(),
    ):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    return tmp_path


def test_checked_in_files_are_the_generated_ones():
    assert config_docs.stale_files(ROOT) == [], "run `.venv/bin/epd config docs` and commit the result"


def test_a_stale_copy_is_named(tmp_path, capsys):
    root = _copy(tmp_path)
    assert main(["config", "docs", "--check", "--root", str(root)]) == 0
    # Negative controls: a dropped row, an edited default.
    doc = root / config_docs.CONFIG_DOC
    doc.write_text("\n".join(line for line in doc.read_text().splitlines() if "`EPD_EC_WAIT_S`" not in line))
    env = root / config_docs.ENV_EXAMPLE
    env.write_text(env.read_text().replace("# EPD_ACK_WAIT_S=4\n", "# EPD_ACK_WAIT_S=60\n"))
    assert main(["config", "docs", "--check", "--root", str(root)]) == 1
    err = capsys.readouterr().err
    assert "docs/configuration.md is stale" in err and ".env.example is stale" in err
    # Regenerating repairs both.
    assert main(["config", "docs", "--root", str(root)]) == 0
    assert config_docs.stale_files(root) == []


def test_minio_policies_are_generated_and_checked(tmp_path, capsys):
    """deploy/minio-policies/<role>.json are written by `epd config docs` from shared/store_auth.py;
    one edited by hand (a statement widened) or removed is named stale, and regenerating repairs it."""
    root = _copy(tmp_path)
    encoder, decode = (config_docs.Path("deploy/minio-policies") / f"{r}.json" for r in ("encoder", "decode"))
    text = (root / encoder).read_text()
    (root / encoder).write_text(text.replace("epd/epd/media/*", "epd/*", 1))
    (root / decode).unlink()
    assert main(["config", "docs", "--check", "--root", str(root)]) == 1
    err = capsys.readouterr().err
    assert f"{encoder} is stale" in err and f"{decode} is stale" in err
    assert main(["config", "docs", "--root", str(root)]) == 0
    assert config_docs.stale_files(root) == []
    assert (root / encoder).read_text() == text


def test_every_setting_is_documented_with_a_description():
    doc = (ROOT / config_docs.CONFIG_DOC).read_text()
    env = (ROOT / config_docs.ENV_EXAMPLE).read_text()
    for section in config_docs.SECTIONS:
        for name, field in section.fields.items():
            var = config_docs.env_name(name)
            assert field.description, f"{section.cls.__name__}.{name} has no description"
            assert f"| `{var}` |" in doc, var
            assert f"{var}=" in env, var
    for var in ("EPD_STORE_FS_ROOT", "EPD_TOPOLOGY"):
        assert f"# {var}=" in env


def test_settings_are_documented_in_one_style():
    """Each setting's description is the docstring under it (pydantic's ``use_attribute_docstrings``),
    never ``Field(description=...)``: one style to read and to write."""
    import ast
    import inspect

    from shared import config

    tree = ast.parse(inspect.getsource(config))
    in_field = [
        f"{cls.name}.{st.target.id}"
        for cls in tree.body
        if isinstance(cls, ast.ClassDef)
        for st in cls.body
        if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name) and isinstance(st.value, ast.Call)
        if any(k.arg == "description" for k in st.value.keywords)
    ]
    assert in_field == []


def test_env_example_ships_no_secret():
    active = {}
    for line in (ROOT / config_docs.ENV_EXAMPLE).read_text().splitlines():
        name, sep, value = line.lstrip("# ").partition("=")
        if sep and name.isupper():
            active[name] = value
    for var in ("EPD_API_KEYS", "EPD_NATS_PASSWORD", "EPD_S3_SECRET_KEY", "MINIO_ROOT_PASSWORD"):
        assert active[var] == "", var
    assert "minioadmin" not in (ROOT / config_docs.ENV_EXAMPLE).read_text()
