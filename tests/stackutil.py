"""Helpers for end-to-end tests: images, stacks of real service processes, stream reading."""

from __future__ import annotations

import asyncio
import base64
import io
import signal
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from PIL import Image

from shared import protocol
from shared.infra import EmbeddedNats, EmbeddedS3
from shared.launcher import Stack
from shared.protocol import Subjects


def noise_image(seed: int, size: tuple[int, int]) -> Image.Image:
    """A deterministic RGB noise image of ``size`` (width, height)."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), "RGB")


def png_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def data_url(img: Image.Image) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(img)).decode()


def user_message(text: str, image_urls: list[str]) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": u}} for u in image_urls]
    parts.append({"type": "text", "text": text})
    return {"role": "user", "content": parts}


def engine_messages(text: str, n_images: int) -> list[dict[str, Any]]:
    """The same message as ``user_message`` in the engine's placeholder form."""
    parts: list[dict[str, Any]] = [{"type": "image"} for _ in range(n_images)]
    parts.append({"type": "text", "text": text})
    return [{"role": "user", "content": parts}]


@dataclass
class RunningStack:
    stack: Stack
    nats_url: str
    prefix: str
    namespace: str
    bucket: str
    env: dict[str, str]
    prefill_metrics_port: int | None = None
    request_timeout_s: float | None = None

    @property
    def url(self) -> str:
        return self.stack.base_url

    @property
    def subjects(self) -> Subjects:
        return Subjects(self.prefix)

    def chat(self, messages: list[dict], *, timeout: float = 120, headers: dict | None = None, **params: Any) -> httpx.Response:
        body = {"model": "qwen2-vl-tiny", "messages": messages, **params}
        return httpx.post(f"{self.url}/v1/chat/completions", json=body, timeout=timeout, headers=headers)

    def stream_messages(self, stream_attr: str) -> list[tuple[str, dict, protocol.Message]]:
        return read_stream(self.nats_url, getattr(self.subjects, stream_attr))


def stack_env(nats: EmbeddedNats, s3: EmbeddedS3, model_dir: Path, **overrides: str) -> tuple[dict[str, str], str, str, str]:
    tag = uuid.uuid4().hex[:8]
    prefix, namespace, bucket = f"t{tag}", f"ns{tag}", f"epd-{tag}"
    env = {
        "EPD_NATS_URL": nats.url,
        "EPD_S3_ENDPOINT": s3.endpoint,
        "EPD_S3_ACCESS_KEY": s3.access_key,
        "EPD_S3_SECRET_KEY": s3.secret_key,
        "EPD_S3_BUCKET": bucket,
        "EPD_NAMESPACE": namespace,
        "EPD_SUBJECT_PREFIX": prefix,
        "EPD_MODEL_PATH": str(model_dir),
        "EPD_MODEL_NAME": "qwen2-vl-tiny",
        "EPD_TORCH_THREADS": "1",
        "EPD_URL_ALLOW_NETWORKS": "127.0.0.0/8",
        "EPD_LOG_LEVEL": "INFO",
        # JetStream reserves max_bytes per stream up front: many test stacks share one server.
        "EPD_STREAM_MAX_BYTES": str(64 * 1024**2),
    }
    env.update(overrides)
    return env, prefix, namespace, bucket


def read_stream(nats_url: str, stream: str) -> list[tuple[str, dict, protocol.Message]]:
    """Every message still in ``stream``: (subject, headers, decoded message), in order."""

    async def main():
        import nats
        from nats.js.errors import NotFoundError

        nc = await nats.connect(nats_url)
        try:
            js = nc.jetstream()
            info = await js.stream_info(stream)
            out = []
            if info.state.messages == 0:
                return out
            for seq in range(info.state.first_seq, info.state.last_seq + 1):
                try:
                    raw = await js.get_msg(stream, seq)
                except NotFoundError:
                    continue
                out.append((raw.subject, dict(raw.headers or {}), protocol.decode(raw.data)))
            return out
        finally:
            await nc.close()

    return asyncio.run(main())


def wait_for(predicate, timeout: float, what: str, *, interval: float = 0.1):
    """Poll ``predicate()`` until it returns something truthy (returned) or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def kv_keys(store, stack) -> set[str]:
    """Keys of the KV objects (E|P|D hand-offs) in a RunningStack's bucket."""
    return {info.key for info in store.list(f"{stack.namespace}/kv/")}


# -- decode workers of a running E|P|D stack ------------------------------------------------------
def decoders(stack):
    """The live decode worker processes of a RunningStack."""
    return [p for p in stack.stack.processes if p.name == "decode" and p.alive()]


def start_decoder(stack, **env):
    """Start one more decode worker (the launcher's command and env, plus ``env``)."""
    index = sum(1 for p in stack.stack.processes if p.name == "decode")
    return stack.stack.add("decode", index=index, extra_env={k: str(v) for k, v in env.items()})


def stop_decoders(stack, sig=signal.SIGTERM):
    for proc in decoders(stack):
        proc.stop(sig)


def stream_killing_a_decoder(stack, body: dict, victim, *, after: int = 3, timeout: float = 600):
    """Stream a chat completion; once ``after`` tokens have arrived, SIGKILL ``victim`` (a decode
    worker process: its whole process group) and start a new decode worker. Returns (token ids,
    request id, tokens seen when killing or None, whether [DONE] arrived)."""
    import json

    ids, rid, killed_after, done = [], None, None, False
    with httpx.stream("POST", f"{stack.url}/v1/chat/completions", json=body, timeout=timeout) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            event = json.loads(line[6:])
            assert "error" not in event, event
            rid = event["id"]
            for choice in event.get("choices", []):
                ids.extend(choice.get("token_ids", []))
            if killed_after is None and len(ids) >= after:
                victim.stop(signal.SIGKILL)
                killed_after = len(ids)
                start_decoder(stack)
    return ids, rid, killed_after, done
