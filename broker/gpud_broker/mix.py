"""The task mix: the running distribution of the requests the broker has been seeing.

The fragmentation-aware policy (``fgd`` in ``policies.py``) judges a placement by how much it hurts
the cluster's ability to take *the requests that keep coming*. This module owns that distribution.
It is kept as exponentially decayed counts over request classes, so it follows the workload as it
drifts instead of being a fixed table: the broker calls ``observe`` for every arriving request.

A class is a request's shape as far as placement is concerned: the share of each GPU, the number of
GPUs, the CPU asked for (rounded up to ``cpu_step``) and the allowed GPU models. The table is
bounded (``max_classes``): past it, the lightest of the other classes is forgotten. Beside the classes the mix keeps
what requests with GPU ask for per milli-GPU of CPU and host memory (decayed the same way).

Readers do not use the live counts directly: ``snapshot()`` returns a published copy and a version
number, and a new copy is published only once the live distribution has moved away from the last
one by more than ``tolerance`` (total variation distance, checked every ``check_every``
observations). Policies key their caches on the version, so a steady workload keeps them warm.
Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

from gpud.resources import MILLI_PER_GPU, Need

DEFAULT_HALF_LIFE = 2000  # observations after which a request's weight has halved
DEFAULT_MAX_CLASSES = 128
DEFAULT_CPU_STEP = 1000  # milli-CPU; class CPU requests are rounded up to a multiple of it
DEFAULT_TOLERANCE = 0.02  # total variation distance that triggers a new snapshot
DEFAULT_CHECK_EVERY = 16  # observations between checks of the distance
CLASS_CACHE_SIZE = 4096  # requests' classes remembered by the Need object (the cache starts again past it)

_RESCALE_AT = 1e200


class NeedClass(NamedTuple):
    """A request shape. ``milli`` is per GPU (0: no GPU at all); ``gpus`` is the number of GPUs.

    A NamedTuple rather than a frozen dataclass: the mix hashes one for every request it counts."""

    milli: int
    gpus: int
    cpu_milli: int
    models: frozenset[str] | None = None

    @classmethod
    def of(cls, need: Need, cpu_step: int = DEFAULT_CPU_STEP) -> NeedClass:
        cpu = -(-need.cpu_milli // cpu_step) * cpu_step if cpu_step > 1 else need.cpu_milli
        if need.gpus == 0 and need.gpu_milli == 0:
            return cls(0, 0, cpu, None)
        milli = MILLI_PER_GPU if need.exclusive else need.milli_per_gpu
        return cls(milli, need.gpu_count, cpu, need.models)

    @property
    def needs_gpu(self) -> bool:
        return self.milli > 0


@dataclass(frozen=True, slots=True)
class MixSnapshot:
    """A published distribution: (class, probability) pairs, heaviest first, summing to 1, and
    what the GPU requests of the mix ask for per milli-GPU on the side (CPU and host memory)."""

    version: int
    classes: tuple[tuple[NeedClass, float], ...]
    observations: int
    cpu_per_milli: float = 0.0  # milli-CPU per milli-GPU
    mem_per_milli: float = 0.0  # host bytes per milli-GPU


class TaskMix:
    """Exponentially decayed counts of request classes.

    Parameters
    ----------
    half_life:
        Observations after which an observation weighs half as much as a new one.
    max_classes:
        Bound on the number of classes kept; the lightest is forgotten past it.
    cpu_step:
        Granularity (milli-CPU) of the CPU part of a class.
    tolerance, check_every:
        When ``snapshot()`` publishes a new version (see the module docstring).
    """

    def __init__(
        self,
        half_life: float = DEFAULT_HALF_LIFE,
        max_classes: int = DEFAULT_MAX_CLASSES,
        cpu_step: int = DEFAULT_CPU_STEP,
        tolerance: float = DEFAULT_TOLERANCE,
        check_every: int = DEFAULT_CHECK_EVERY,
    ) -> None:
        if half_life <= 0 or max_classes < 1 or cpu_step < 1 or tolerance < 0 or check_every < 1:
            raise ValueError("TaskMix: half_life > 0, max_classes >= 1, cpu_step >= 1, tolerance >= 0")
        self.growth = 2.0 ** (1.0 / half_life)  # each observation weighs this much more than the last
        self.max_classes = max_classes
        self.cpu_step = cpu_step
        self.tolerance = tolerance
        self.check_every = check_every
        self._weights: dict[NeedClass, float] = {}
        # id(need) -> (need, its class, its milli-GPU): the broker passes the same few Need objects
        self._classes: dict[int, tuple[Need, NeedClass, int]] = {}
        self._total = 0.0
        # decayed sums over requests with GPU: milli-GPU, milli-CPU, host bytes
        self._gpu = 0.0
        self._cpu = 0.0
        self._mem = 0.0
        self._inc = 1.0
        self.observations = 0
        self._since_check = 0
        self._snapshot = MixSnapshot(0, (), 0)

    def __len__(self) -> int:
        return len(self._weights)

    def observe(self, need: Need) -> NeedClass:
        """Count one arriving request; returns its class."""
        got = self._classes.get(id(need))
        if got is None or got[0] is not need:
            if len(self._classes) >= CLASS_CACHE_SIZE:
                self._classes.clear()
            got = self._classes[id(need)] = (need, NeedClass.of(need, self.cpu_step), need.total_milli)
        _, cls, total_milli = got
        w = self._weights
        inc = self._inc
        weight = w.get(cls)
        if weight is not None:
            w[cls] = weight + inc
        else:
            w[cls] = inc
            if len(w) > self.max_classes:
                # The lightest of the others goes (the newcomer would always be the lightest).
                lightest = min((k for k in w if k != cls), key=w.__getitem__)
                self._total -= w.pop(lightest)
        self._total += inc
        if cls.milli:
            self._gpu += inc * total_milli
            self._cpu += inc * need.cpu_milli
            self._mem += inc * need.host_mem
        self._inc = inc * self.growth
        if self._inc > _RESCALE_AT:
            scale = 1.0 / self._inc
            for k in w:
                w[k] *= scale
            self._total *= scale
            self._gpu *= scale
            self._cpu *= scale
            self._mem *= scale
            self._inc = 1.0
        self.observations += 1
        self._since_check += 1
        return cls

    def items(self) -> Iterator[tuple[NeedClass, float]]:
        """The live distribution: (class, probability), in no particular order."""
        total = self._total
        if total <= 0:
            return iter(())
        return ((c, v / total) for c, v in self._weights.items())

    @property
    def cpu_per_milli(self) -> float:
        """Milli-CPU the requests with GPU ask for per milli-GPU (decayed like the counts)."""
        return self._cpu / self._gpu if self._gpu > 0 else 0.0

    @property
    def mem_per_milli(self) -> float:
        """Host memory (bytes) the requests with GPU ask for per milli-GPU."""
        return self._mem / self._gpu if self._gpu > 0 else 0.0

    def probability(self, cls: NeedClass) -> float:
        return self._weights.get(cls, 0.0) / self._total if self._total > 0 else 0.0

    def __iter__(self) -> Iterator[tuple[NeedClass, float]]:
        return self.items()

    def distance(self) -> float:
        """Total variation distance between the live distribution and the published snapshot."""
        live = dict(self.items())
        published = dict(self._snapshot.classes)
        keys = live.keys() | published.keys()
        return 0.5 * sum(abs(live.get(k, 0.0) - published.get(k, 0.0)) for k in keys)

    def snapshot(self) -> MixSnapshot:
        """The published distribution; republished first when the live one has moved enough."""
        snap = self._snapshot
        if self._since_check >= self.check_every or (snap.version == 0 and self._total > 0):
            self._since_check = 0
            if snap.version == 0 or self.distance() > self.tolerance:
                self.publish()
        return self._snapshot

    def publish(self) -> MixSnapshot:
        """Publish the live distribution now (a new version)."""
        classes = tuple(sorted(self.items(), key=lambda cp: -cp[1]))
        self._snapshot = MixSnapshot(
            self._snapshot.version + 1, classes, self.observations, self.cpu_per_milli, self.mem_per_milli
        )
        self._since_check = 0
        return self._snapshot
