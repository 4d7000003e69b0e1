"""Driving gpud's OpenStack code in the test process: the controller
(gpud_broker.openstack.controller) as the broker's loop drives it (a real BrokerCore, ``on_tick``
called in a loop, admin commands as ``gpudctl openstack`` sends them, a worker's READY as the VM's
gpud-worker would send it), and the Nova client's waits between retries, recorded instead of
slept. Used against real Nova (tests/integration/test_openstack_*.py) and against the fault server
(tests/unit/test_openstack_*.py)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from gpud import protocol as P
from gpud.config import OpenStackConfig
from gpud.protocol import Command, Peer
from gpud_broker.core import BrokerConfig, BrokerCore
from gpud_broker.openstack.controller import Controller

GiB = 1 << 30


class Waits:
    """The ``wait`` of gpud's Nova client: records the retry delays instead of sleeping them."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    def __call__(self, seconds: float) -> bool:
        self.delays.append(seconds)
        return False


def config(**over: object) -> OpenStackConfig:
    base = dict(enabled=True, image="ubuntu-gpu", flavor="g1.a100", brokers=("tcp://control-1:5556",), max_workers=2,
                poll_interval=0.1, api_timeout=5.0, api_retries=0, boot_timeout=30.0, retire_timeout=5.0)
    return dataclasses.replace(OpenStackConfig(), **{**base, **over})  # type: ignore[arg-type]


def core() -> BrokerCore:
    return BrokerCore(BrokerConfig(), time.monotonic(), lambda i, f: None, lambda i, f: None)


def ready(c: BrokerCore, name: str, instance_id: str) -> None:
    """Worker ``name`` (one simulated GPU) registers, saying it runs on server ``instance_id``."""
    gpus = [{"uuid": f"GPU-{name}", "index": 0, "model": "A100", "mem": 16 * GiB, "cc": [8, 0]}]
    enc = P.encode(Peer.WORKER, Command.READY, {"name": name, "gpus": gpus, "slots": 4, "instance_id": instance_id})
    c.on_worker(name.encode(), P.decode(enc, Peer.WORKER), enc[2])


def tick_until(ctl: Controller, c: BrokerCore, pred: Callable[[], Any], what: str, timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        c.now = time.monotonic()
        ctl.on_tick(c, c.now)
        value = pred()
        if value:
            return value
        if c.now > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def admin(ctl: Controller, c: BrokerCore, **args: Any) -> dict[str, Any]:
    """What ``gpudctl openstack ACTION`` asks the broker."""
    c.now = time.monotonic()
    return ctl.admin(c, {"worker": None, "count": None, **args})


def last_action(ctl: Controller, c: BrokerCore) -> dict[str, Any]:
    row: dict[str, Any] = admin(ctl, c, action="actions")["actions"][0]
    return row
