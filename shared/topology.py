"""The one topology table: which services a topology runs and which role each worker plays.

Words, used with one meaning each across the code:

* **topology** (:class:`Topology`, ``EPD_TOPOLOGY``, ``epd up --topology``): how a deployment splits
  the work - ``agg`` (one worker does everything), ``e-pd`` (encoder | prefill+decode), ``e-p-d``
  (encoder | prefill | decode).
* **service** (:class:`Service`): a process kind, ``python -m services.<service>``.
* **role** (:class:`Role`, ``EPD_ROLE`` for the prefill service): the part a worker plays, which
  decides its handler strategies and what its engine must support (``shared.engines``).

A worker's heartbeat (the API's ``/health`` ``workers`` counts, ``epd healthcheck --role``) names
its *service*, not its role: an E|PD and an E|P|D prefill worker both beat as ``prefill``.

vLLM's own connector roles (``ec_producer``, ``kv_consumer``, ...) are derived from :class:`Role`
inside the vLLM engine; they are vLLM's words, not ours.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


# StrEnum: ``str(Role.PD) == f"{Role.PD}" == "pd"`` (a ``(str, Enum)`` formats as ``Role.PD``),
# so members go into env variables, subjects and log lines as their values.
class Topology(enum.StrEnum):
    AGG = "agg"
    E_PD = "e-pd"
    E_P_D = "e-p-d"


class Service(enum.StrEnum):
    API = "api"
    ENCODER = "encoder"
    PREFILL = "prefill"
    DECODE = "decode"


class Role(enum.StrEnum):
    """What a worker does with a job."""

    #: EncodeJob -> encoder outputs in the store.
    ENCODER = "encoder"
    #: E|PD: GenerationJob -> features from the store / encoder -> prefill + decode here.
    PD = "pd"
    #: E|P|D: GenerationJob -> prefill -> decode state handed to a decode worker.
    PREFILL = "prefill"
    #: E|P|D: DecodeJob -> decode from the handed-over state.
    DECODE = "decode"
    #: The baseline: encode + prefill + decode in one process, no store, no encoder workers.
    AGG = "agg"


#: Roles the prefill service can play (``EPD_ROLE``).
PREFILL_SERVICE_ROLES = (Role.PD, Role.PREFILL, Role.AGG)


@dataclass(frozen=True)
class TopologySpec:
    services: tuple[Service, ...]
    #: The role of the prefill service's workers in this topology.
    prefill_role: Role

    @property
    def worker_services(self) -> tuple[Service, ...]:
        """The worker services, whose heartbeats the API's ``/health`` counts (by service name)."""
        return tuple(s for s in self.services if s is not Service.API)

    @property
    def uses_encoder(self) -> bool:
        """The API publishes encode jobs (agg encodes inside its one worker)."""
        return Service.ENCODER in self.services


TOPOLOGIES: dict[Topology, TopologySpec] = {
    Topology.AGG: TopologySpec((Service.API, Service.PREFILL), Role.AGG),
    Topology.E_PD: TopologySpec((Service.API, Service.ENCODER, Service.PREFILL), Role.PD),
    Topology.E_P_D: TopologySpec((Service.API, Service.ENCODER, Service.PREFILL, Service.DECODE), Role.PREFILL),
}


def service_of(role: Role) -> Service:
    """The service process that plays ``role``."""
    role = Role(role)  # a plain value too: an unknown one raises instead of landing in prefill
    if role is Role.ENCODER:
        return Service.ENCODER
    if role is Role.DECODE:
        return Service.DECODE
    return Service.PREFILL
