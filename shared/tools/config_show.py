"""``epd config show``: the settings in effect in this environment, for every service or one.

Each ``EPD_*`` setting of ``shared/config.py`` with the value a service started here would use
(from the environment, else the default), where it came from, and which services read it.
Secrets are masked (``SecretStr`` fields and :data:`shared.tools.config_docs.SECRET_VARS`) and a
URL's password is redacted; retired settings that are set are named. Exit codes: 0; 2 when a
setting's value is invalid (named, as the service would refuse it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from pydantic import SecretStr, ValidationError

from shared import config

MASK = "****"
#: settings whose values are URLs that may carry a password
URL_VARS = ("EPD_NATS_URL",)


def _classes() -> dict[str, type[config.ServiceSettings]]:
    return {**config.SERVICE_SETTINGS, "tools": config.ToolSettings}


def shown_value(name: str, value: Any) -> Any:
    """``value`` of the setting ``name`` as ``epd config show`` prints it: secrets masked."""
    from shared.jetstream import redact_url
    from shared.tools.config_docs import SECRET_VARS

    if value is None:
        return None
    if isinstance(value, SecretStr) or name in SECRET_VARS:
        return MASK if value else value
    if name in URL_VARS and isinstance(value, str):
        return ",".join(redact_url(u) for u in value.split(","))
    if isinstance(value, tuple):
        return list(value)
    if hasattr(value, "value"):  # an enum member
        return value.value
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return value


def effective(service: str | None = None) -> list[dict[str, Any]]:
    """One row per setting (``name``, ``value``, ``source``: env or default, ``read_by``), sorted by
    name; ``service``: only the settings that service reads. Raises ``ValidationError``."""
    classes = _classes()
    if service is not None:
        classes = {service: classes[service]}
    rows: dict[str, dict[str, Any]] = {}
    for svc, cls in classes.items():
        settings = cls()
        for field in cls.env_fields():
            name = config.env_var(field)
            if name in rows:
                rows[name]["read_by"].append(svc)
                continue
            rows[name] = {
                "name": name,
                "value": shown_value(name, settings.setting(field)),
                "source": "env" if os.environ.get(name) else "default",
                "read_by": [svc],
            }
    return [rows[n] for n in sorted(rows)]


def cmd_show(args: argparse.Namespace) -> int:
    try:
        rows = effective(args.service)
    except ValidationError as exc:
        print(f"epd config show: invalid settings in the environment:\n{exc}", file=sys.stderr)
        return 2
    if args.env_only:
        rows = [r for r in rows if r["source"] == "env"]
    retired = config.retired_settings_in(os.environ)
    if args.json:
        print(json.dumps({"settings": rows, "retired": retired}, indent=2))
        return 0
    width = max((len(r["name"]) for r in rows), default=0)
    for r in rows:
        value = "" if r["value"] is None else r["value"]
        if isinstance(value, list):
            value = ",".join(map(str, value))
        print(f"{r['name']:<{width}}  {value!s:<28}  {r['source']:<7}  {', '.join(r['read_by'])}")
    for line in retired:
        print(f"(set but retired) {line}")
    return 0


def add_parser(config_sub: Any) -> None:
    """Add ``show`` to ``epd config``'s subcommands."""
    show = config_sub.add_parser(
        "show",
        help="the settings in effect here: value (secrets masked), env or default, which services read it",
    )
    show.add_argument("--service", choices=list(_classes()), help="only the settings this service (or tools) reads")
    show.add_argument("--env-only", action="store_true", help="only the settings set in the environment")
    show.add_argument("--json", action="store_true", help="print JSON")
    show.set_defaults(func=cmd_show)
