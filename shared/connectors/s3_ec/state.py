"""Scheduler-side state of the EC connector: one record per (request, item), one per stored
object, and the outcome of a lookup. No vLLM or torch import."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import re

from shared.connectors.params import Source
from shared.metrics import LookupOutcome
from shared.store.format import ECObject, MissReason

# An identifier becomes one key segment: no '/', no leading dot, bounded.
_IDENTIFIER = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:=+-]{0,254}$")


def valid_identifier(identifier: str) -> bool:
    """Whether vLLM's item identifier (mm_hash) can name an EC object."""
    return isinstance(identifier, str) and bool(_IDENTIFIER.match(identifier)) and ".." not in identifier


@dataclasses.dataclass
class ItemState:
    """One multimodal item of one request, on a consumer's scheduler side."""

    identifier: str
    #: the admission decision: HIT (validated bytes pinned for this request) or why not;
    #: None while undecided
    outcome: LookupOutcome | None = None
    reason: MissReason | None = None
    #: a failed fetch's verdict for this request, applied at its next admission check (where
    #: the request's item - and whether it carries local input - is at hand)
    verdict: tuple[LookupOutcome, MissReason] | None = None
    #: where vLLM takes the item from, set when vLLM allocates it; None: vLLM had it itself
    source: Source | None = None

    @property
    def decided(self) -> bool:
        return self.outcome is not None

    def report(self) -> str:
        """The item's ``ec_transfer_params`` source (``store`` / ``recomputed:<reason>`` /
        ``engine_cache``)."""
        if self.source is None:
            return Source.ENGINE_CACHE.report()
        return self.source.report(self.reason.value if self.reason is not None else "")


@dataclasses.dataclass
class RequestState:
    """A consumer's scheduler-side state of one request."""

    request_id: str
    items: dict[str, ItemState] = dataclasses.field(default_factory=dict)
    #: an item is unobtainable without local input: reported (once) through
    #: ``take_unavailable_requests``, and the request is not admitted until then
    unavailable: bool = False

    def item(self, identifier: str) -> ItemState:
        state = self.items.get(identifier)
        if state is None:
            state = self.items[identifier] = ItemState(identifier)
        return state


@dataclasses.dataclass
class StoredItem:
    """One identifier's EC object as a consumer's scheduler knows it (shared by every request
    that uses the item)."""

    identifier: str
    #: validated object held in this process, None when not held
    obj: ECObject | None = None
    #: requests told "ready": the object is not evicted while any is pinned
    pinned_by: set[str] = dataclasses.field(default_factory=set)
    #: background fetch in flight (existence check, GET, validation) and when it started
    fetch: concurrent.futures.Future | None = None
    fetch_started: float = 0.0
    #: requests waiting for that fetch
    waiters: set[str] = dataclasses.field(default_factory=set)
    #: last existence answer and when it was given (monotonic); None: never asked
    exists: bool | None = None
    checked_at: float = 0.0

    @property
    def nbytes(self) -> int:
        return len(self.obj.data) if self.obj is not None else 0

    def idle(self) -> bool:
        """Nothing but (maybe) an existence answer: safe to forget."""
        return self.obj is None and self.fetch is None and not self.waiters and not self.pinned_by


@dataclasses.dataclass(frozen=True)
class FetchResult:
    """What a background fetch found."""

    obj: ECObject | None
    reason: MissReason | None
    #: the existence check said yes (so a failure is a fallback, not a miss)
    existed: bool
    seconds: float
    detail: str = ""
