"""A NATS client run inside a lab host (``python -m tests.multihost.probe SPEC``): what one identity
may do from there, node by node. ``site.Site.probe`` runs it through the host's ``ip netns exec``.

SPEC (JSON, argv[1]): ``urls`` (the nodes to try, one connection each, all at once), ``user``
(None: no identity; the password comes from :data:`PASSWORD_ENV`, never the command line), ``ca``
(the CA the servers are verified against: TLS from the first byte, as the services connect; None:
plaintext), ``publish`` (label -> subject), ``stream_info`` (streams to look up), ``routes``
(``host:port`` cluster ports to knock on with a wrong route password) and ``route_certs`` (label ->
[certificate, key] a knock presents; each route port is also knocked on in plaintext). Prints one
JSON object: per URL whether it connected (the error if not), the client address and server name
the server saw, per label whether the server refused the publish (a permissions violation), per
stream whether its info was answered; per route port and knock whether the TLS handshake was
accepted and the answer to the wrong password.

Every publish carries ``Nats-Expected-Stream`` naming no stream: a publish the server lets through
reaches the subscribers of that subject, but JetStream stores nothing (a generation job allowed by
mistake would otherwise be run by a worker of the site).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import ssl
import sys
from typing import Any

PASSWORD_ENV = "MH_PROBE_PASSWORD"
#: The stream no publish of the probe may land in (JetStream refuses to store it elsewhere).
NO_STREAM = "MH_PROBE_NO_SUCH_STREAM"
HEADERS = {"Nats-Expected-Stream": NO_STREAM}


async def _one(url: str, spec: dict[str, Any]) -> dict[str, Any]:
    import nats.errors

    from shared.config import NatsSettings
    from shared.errors import ServiceUnavailable
    from shared.jetstream import connect

    errors: list[str] = []

    async def on_error(exc: BaseException) -> None:
        errors.append(str(exc))

    user = spec.get("user")
    settings = NatsSettings(
        nats_url=url,
        subject_prefix=spec["prefix"],
        nats_user=user,
        nats_password=os.environ.get(PASSWORD_ENV) if user else None,
        nats_tls_ca=spec.get("ca"),
    )
    out: dict[str, Any] = {"url": url, "user": user}
    try:
        nc = await connect(
            settings,
            name=f"mh-probe-{user or 'anonymous'}",
            connect_timeout=5,
            allow_reconnect=False,
            max_reconnect_attempts=0,
            error_cb=on_error,
        )
    except ServiceUnavailable as exc:  # with the server's reason
        return {**out, "connected": False, "error": f"{type(exc).__name__}: {exc}"}
    info = getattr(nc, "_server_info", {}) or {}
    out.update(connected=True, error=None, client_ip=info.get("client_ip"), server_name=info.get("server_name"))
    try:
        refused: dict[str, bool] = {}
        for label, subject in (spec.get("publish") or {}).items():
            errors.clear()
            await nc.publish(subject, b"mh-probe", headers=HEADERS)
            # the server reports a violation before it answers the flush's ping; nats-py hands the
            # -ERR to the callback in a task of its own
            await nc.flush(timeout=5)
            await asyncio.sleep(0.1)
            refused[label] = any("permissions violation" in e.lower() and subject in e for e in errors)
        out["refused"] = refused
        answered: dict[str, bool] = {}
        js = nc.jetstream(timeout=5)
        for stream in spec.get("stream_info") or []:
            try:
                await js.stream_info(stream)
                answered[stream] = True
            except (nats.errors.Error, TimeoutError):  # refused: no answer; not found
                answered[stream] = False
        out["info"] = answered
        out["errors"] = errors[:5]
    finally:
        await nc.close()
    return out


def _route_connect(cluster: str) -> bytes:
    connect = {
        "user": "mh-probe",
        "pass": "not-the-route-password",
        "verbose": False,
        "pedantic": False,
        "tls_required": True,
        "name": "mh-probe",
        "cluster": cluster,
    }
    return f"CONNECT {json.dumps(connect)}\r\nPING\r\n".encode()


def _knock(address: str, ca: str | None, cert: list[str] | None) -> dict[str, Any]:
    """Open a route connection to ``address`` (a cluster port) with a wrong password: over TLS
    presenting ``cert`` (the server verified against ``ca``), or in plaintext (``cert`` None).
    Returns whether the TLS handshake was accepted (``tls``: ``ok`` or the error), the first line
    the server sent (its INFO's ``auth_required``) and its answer to the CONNECT."""
    host, port = address.rsplit(":", 1)
    out: dict[str, Any] = {"tls": None, "auth_required": None, "answer": ""}
    with socket.create_connection((host, int(port)), timeout=5) as raw:
        sock: socket.socket = raw
        if cert is not None:
            ctx = ssl.create_default_context(cafile=ca)
            ctx.load_cert_chain(*cert)
            try:
                sock = ctx.wrap_socket(raw, server_hostname=host)
                reader = sock.makefile("rb")
                # (TLS 1.3: the server refuses a client certificate after the handshake: the first read)
                line = reader.readline().decode(errors="replace")
            except (ssl.SSLError, OSError) as exc:
                return {**out, "tls": f"{type(exc).__name__}: {exc}"}
            out["tls"] = "ok"
        else:  # what a plaintext client (or route) sends first; a TLS-first port takes it for a bad handshake
            raw.sendall(_route_connect(""))
            try:
                out["answer"] = raw.recv(4096).decode(errors="replace")
            except OSError as exc:
                out["answer"] = f"{type(exc).__name__}"
            return out
        info = json.loads(line.split(" ", 1)[1]) if line.startswith("INFO ") else {}
        out["auth_required"] = bool(info.get("auth_required"))
        sock.sendall(_route_connect(info.get("cluster", "")))
        try:
            answer = ""
            while not answer or answer.startswith("INFO"):  # (gossip)
                got = reader.readline().decode(errors="replace").strip()
                if not got:
                    break
                answer = got
        except OSError as exc:
            answer = f"{type(exc).__name__}"
        out["answer"] = answer
    return out


async def main(spec: dict[str, Any]) -> dict[str, Any]:
    nodes = list(await asyncio.gather(*(_one(url, spec) for url in spec.get("urls") or [])))
    knocks: dict[str, list[str] | None] = {"plaintext": None, **(spec.get("route_certs") or {})}
    routes = {
        address: {label: _knock(address, spec.get("ca"), cert) for label, cert in knocks.items()}
        for address in spec.get("routes") or []
    }
    return {"nodes": nodes, "routes": routes}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(json.loads(sys.argv[1])))))
