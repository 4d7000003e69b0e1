"""Request statistics the broker core keeps for its metrics: plain ints, updated on the hot path.

Requests accepted by kind, errors answered by code, and a latency histogram per kind (seconds from
acceptance to the reply). Each update is a dict lookup and an increment or a bisect, so the core
can afford one per request; the Prometheus collector (``metrics.py``) reads them at scrape time.
Pure: no I/O, no clock (the core passes durations).
"""

from __future__ import annotations

from bisect import bisect_left

from gpud.errors import CODES

# Upper bounds (seconds, "less than or equal") of the latency buckets: from an echo's sub-millisecond
# round trip to jobs of minutes. The last bucket (+Inf) is implicit.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
)

OTHER = "OTHER"  # the error code counted for codes outside the table (a worker's own strings)


class Histogram:
    """Observation counts per bucket (not cumulative) and their sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def cumulative(self) -> tuple[list[tuple[float, int]], int, float]:
        """``([(upper bound, count <= it), ...], total count, sum)``; the +Inf bucket is the total."""
        counts = list(self.counts)  # one consistent copy (the broker thread keeps counting)
        total = 0
        out = []
        for bound, n in zip(self.bounds, counts, strict=False):
            total += n
            out.append((bound, total))
        return out, total + counts[-1], self.sum


MAX_TENANTS = 256  # tenants counted by name; the others together as OTHER_TENANT
OTHER_TENANT = "(other)"  # not a valid tenant name: it cannot be taken by one


class RequestStats:
    """What the broker counts per request: accepted by kind and by tenant, errors by code and by
    tenant, the wait in the queue by kind (acceptance to the first dispatch), the latency by kind
    (acceptance to the reply: its count is the requests answered), and the requests taken over
    from the pair's other broker (accepted there, answered here).

    Per tenant at most ``MAX_TENANTS`` names: a tenant's name is the client's word where there is
    no CURVE, and a metric label per name it makes up would grow the broker without bound."""

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.bounds = bounds
        self.accepted: dict[str, int] = {}
        self.errors: dict[str, int] = {}
        self.latency: dict[str, Histogram] = {}
        self.waited: dict[str, Histogram] = {}
        self.taken_over: dict[str, int] = {}
        self.tenant_requests: dict[str, int] = {}
        self.tenant_errors: dict[str, int] = {}

    def _tenant(self, table: dict[str, int], tenant: str) -> None:
        if tenant not in table and len(table) >= MAX_TENANTS:
            tenant = OTHER_TENANT
        table[tenant] = table.get(tenant, 0) + 1

    def accept(self, kind: str, tenant: str | None = None) -> None:
        """A request of ``kind`` was accepted (queued or dispatched; not a retry, not refused)."""
        self.accepted[kind] = self.accepted.get(kind, 0) + 1
        if tenant is not None:
            self._tenant(self.tenant_requests, tenant)

    def dispatched(self, kind: str, seconds: float) -> None:
        """A request of ``kind`` left the queue for a worker ``seconds`` after it was accepted."""
        h = self.waited.get(kind)
        if h is None:
            h = self.waited[kind] = Histogram(self.bounds)
        h.observe(seconds)

    def finish(self, kind: str, seconds: float) -> None:
        """A request of ``kind`` was answered ``seconds`` after it was accepted."""
        h = self.latency.get(kind)
        if h is None:
            h = self.latency[kind] = Histogram(self.bounds)
        h.observe(seconds)

    def take_over(self, kind: str) -> None:
        """A request of ``kind`` that the other broker of the pair accepted is this one's now."""
        self.taken_over[kind] = self.taken_over.get(kind, 0) + 1

    def error(self, code: object, tenant: str | None = None) -> None:
        """A request was answered with error ``code`` (codes outside the table count as OTHER)."""
        key = code if type(code) is str and code in CODES else OTHER
        self.errors[key] = self.errors.get(key, 0) + 1
        if tenant is not None:
            self._tenant(self.tenant_errors, tenant)

    def answered(self) -> dict[str, int]:
        """Requests answered, by kind."""
        return {kind: h.cumulative()[1] for kind, h in list(self.latency.items())}


class PlacementTimes:
    """How long placement decisions take: the most recent ``size`` samples in a ring, plus the
    count and the maximum since start. ``record`` is two stores and a compare; percentiles are
    computed when asked (admin ``status``), over the ring."""

    __slots__ = ("count", "max", "samples", "size")

    def __init__(self, size: int = 8192) -> None:
        self.size = size
        self.samples = [0.0] * size
        self.count = 0
        self.max = 0.0

    def record(self, seconds: float) -> None:
        self.samples[self.count % self.size] = seconds
        self.count += 1
        if seconds > self.max:
            self.max = seconds

    def summary(self) -> dict[str, float | int]:
        """``{"count", "p50_us", "p99_us", "max_us"}``: count and max since start, the percentiles
        over the most recent samples (0 before the first decision)."""
        recent = sorted(self.samples[: min(self.count, self.size)])
        n = len(recent)

        def pct(q: float) -> float:
            return round(recent[min(n - 1, int(q * n))] * 1e6, 1) if n else 0.0

        return {"count": self.count, "p50_us": pct(0.50), "p99_us": pct(0.99), "max_us": round(self.max * 1e6, 1)}
