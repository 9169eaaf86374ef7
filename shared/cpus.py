"""CPU binding of a worker process (``EPD_CPU_CORES``), so an encoder engine and a PD engine on one
host do not fight for the same cores.

A worker binds itself before it loads anything: ``os.sched_setaffinity`` for the process (torch's
threads and any child process inherit it), and, for vLLM's CPU engine processes, which bind their
OpenMP threads themselves, ``VLLM_CPU_OMP_THREADS_BIND`` set to the same list unless it is set
already. The list uses Linux's syntax: ``0``, ``0-3``, ``0,2,4-5``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

log = logging.getLogger(__name__)


def parse_cpu_list(text: str) -> list[int]:
    """``"0,2-3"`` -> ``[0, 2, 3]``. Raises ValueError on anything else."""
    cores: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad CPU list {text!r}: use ids and ranges, e.g. 0,2-3")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"bad CPU range {part!r} in {text!r}")
        cores.update(range(first, last + 1))
    if not cores:
        raise ValueError(f"empty CPU list {text!r}")
    return sorted(cores)


def format_cpu_list(cores: Sequence[int]) -> str:
    """``[0, 2, 3]`` -> ``"0,2-3"``."""
    out: list[str] = []
    ordered = sorted(set(cores))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        out.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(out)


def available_cpus() -> list[int]:
    """The CPUs this process may run on."""
    return sorted(os.sched_getaffinity(0))


def bind_process(cpu_list: str | None) -> list[int] | None:
    """Bind this process (and what it starts) to ``cpu_list``; None: leave it as it is. Returns the
    cores bound to. Raises ValueError for a list that is malformed or names no usable CPU."""
    if not cpu_list:
        return None
    available = available_cpus()
    usable = sorted(set(parse_cpu_list(cpu_list)) & set(available))
    if not usable:
        raise ValueError(
            f"EPD_CPU_CORES={cpu_list}: none of these CPUs is available (have {format_cpu_list(available)})"
        )
    os.sched_setaffinity(0, usable)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", format_cpu_list(usable))
    log.info("bound to CPU(s) %s", format_cpu_list(usable))
    return usable


def lower_priority(nice: int) -> int:
    """Raise this process's nice value to ``nice`` (0: leave it); what it starts afterwards inherits
    it, vLLM's engine processes included. A process can only lower its own priority, so a value
    below the current one changes nothing. Returns the nice value the process has.

    Where the kernel groups processes by session for scheduling (``sched_autogroup_enabled``, the
    default of most distributions), a nice value only weighs against the processes of the same
    session: a worker in a session of its own (``epd up`` starts every service in one) competes
    with the others as its session's autogroup. So a session leader sets its autogroup's nice
    too (``/proc/self/autogroup``), which covers the engine processes it starts."""
    current = os.getpriority(os.PRIO_PROCESS, 0)
    if nice <= current:
        return current
    os.setpriority(os.PRIO_PROCESS, 0, nice)
    grouped = _autogroups_enabled()
    if grouped and os.getsid(0) == os.getpid():
        try:
            with open("/proc/self/autogroup", "w") as fh:
                fh.write(str(nice))
        except OSError as exc:  # e.g. a read-only /proc in a container: the process's own value stays
            log.warning("CPU priority lowered to nice %d, but not its session's autogroup (%s)", nice, exc)
        else:
            log.info("CPU priority lowered to nice %d (the process and its session's autogroup)", nice)
    elif grouped:
        log.warning(
            "CPU priority lowered to nice %d, but only against the processes of this session: the kernel "
            "schedules sessions as groups (sched_autogroup_enabled) and this process does not lead its own",
            nice,
        )
    else:
        log.info("CPU priority lowered to nice %d", nice)
    return nice


def _autogroups_enabled() -> bool:
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled") as fh:
            return fh.read().strip() == "1"
    except OSError:  # a kernel built without it
        return False


def split_cpus(cpus: Sequence[int], services: Sequence[str]) -> dict[str, str]:
    """Disjoint CPU lists for ``services`` in order (``epd up --cores auto``): as even as the count
    allows, the first ones getting the remainder; with fewer CPUs than services the last CPU is
    shared by the rest."""
    cpus = sorted(cpus)
    if not cpus or not services:
        return {}
    out: dict[str, str] = {}
    if len(cpus) < len(services):
        for i, name in enumerate(services):
            out[name] = str(cpus[min(i, len(cpus) - 1)])
        return out
    per, extra = divmod(len(cpus), len(services))
    start = 0
    for i, name in enumerate(services):
        n = per + (1 if i < extra else 0)
        out[name] = format_cpu_list(cpus[start : start + n])
        start += n
    return out
