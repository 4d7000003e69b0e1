"""Job inputs from files on disk and outputs into a directory (``Client.submit``'s ``files``
values as ``pathlib.Path``, and ``outputs_to``): a dataset or a model goes from the page cache to
the broker's spool and the job, and its outputs come back into files, neither held whole in the
client's memory; the bytes are right, a half-read output never looks whole, and the client
writes only the files it asked for.

Real daemons (a broker and a worker with two simulated GPUs, labelled simulated) as subprocesses
on loopback, the real client (in a process of its own where its memory is measured), real jobs
under restricted users.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpud.errors import InvalidRequest
from gpud_cli.cluster import LocalCluster
from gpud_client import Client

pytestmark = pytest.mark.timeout(300) if hasattr(pytest.mark, "timeout") else []

MiB = 1 << 20
BIG = 256 * MiB  # a staged input and a staged output, each
ANON_BOUND = 96 * MiB  # the client's anonymous memory growth while both go through it
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(workers=1, gpus_per_worker=2, rundir=tmp_path_factory.mktemp("ondisk")) as c:
        yield c


def pattern(nbytes: int, seed: int) -> bytes:
    block = hashlib.sha256(seed.to_bytes(4, "big")).digest() * (MiB // 32)
    out = bytearray(block * (nbytes // MiB) + block[: nbytes % MiB])
    for i in range(0, len(out) - 8, MiB):
        out[i : i + 8] = i.to_bytes(8, "big")  # a chunk at a wrong offset shows in the checksum
    return bytes(out)


def test_path_inputs_and_outputs_to_a_directory_come_out_right(cluster: LocalCluster, tmp_path: Path) -> None:
    big, small = tmp_path / "dataset.bin", tmp_path / "config.txt"
    big.write_bytes(data := pattern(40 * MiB, 1))
    small.write_bytes(b"small\n")
    (tmp_path / "empty").write_bytes(b"")
    out = tmp_path / "out"
    out.mkdir()
    (out / "big").write_bytes(b"an older file of the same name")
    script = f"md5sum dataset.bin config.txt empty inline; yes abc | head -c {20 * MiB} > big; echo hi > little"
    with Client(cluster.frontend, timeout=60) as c:
        res = c.run(["sh", "-c", script], files={"dataset.bin": big, "config.txt": small, "empty": tmp_path / "empty",
                                                 "inline": b"bytes still work"},
                    outputs=["big", "little", "absent"], outputs_to=out, gpu_milli=100, time_limit=60)
        assert res.exit_code == 0, res.stderr
        sums = dict(reversed(line.split()) for line in res.stdout.decode().splitlines())
        assert sums == {"dataset.bin": hashlib.md5(data).hexdigest(), "config.txt": hashlib.md5(b"small\n").hexdigest(),
                        "empty": hashlib.md5(b"").hexdigest(), "inline": hashlib.md5(b"bytes still work").hexdigest()}
        assert res.files == {} and res.paths == {"big": out / "big", "little": out / "little"}
        assert (out / "big").read_bytes() == (b"abc\n" * (5 * MiB + 1))[: 20 * MiB]
        assert (out / "little").read_bytes() == b"hi\n"
        # Small outputs (inline in the REPLY) go to the directory too.
        res = c.run(["sh", "-c", "echo tiny > little"], outputs=["little"], outputs_to=out, gpu_milli=100)
        assert res.paths == {"little": out / "little"} and (out / "little").read_bytes() == b"tiny\n"
        assert sorted(p.name for p in out.iterdir()) == ["big", "little"]  # no partial file left
        # A file that does not tell its size (procfs says 0) is read, not sent empty.
        res = c.run(["cat", "status"], files={"status": Path("/proc/self/status")}, gpu_milli=100)
        assert res.stdout.startswith(b"Name:"), res.stdout[:100]
        # Bad paths are the caller's error, said before anything is sent.
        with pytest.raises(InvalidRequest, match="cannot open .*nowhere: No such file"):
            c.run(["true"], files={"a": tmp_path / "nowhere"})
        with pytest.raises(InvalidRequest, match="is not a regular file"):
            c.run(["true"], files={"a": tmp_path})
        with pytest.raises(InvalidRequest, match="a path as pathlib.Path, not a str"):
            c.run(["true"], files={"a": str(big)})
        with pytest.raises(InvalidRequest, match="is not a directory"):
            c.run(["true"], outputs=["x"], outputs_to=big)


def test_an_output_that_cannot_be_written_leaves_no_file_and_never_follows_a_link(
        cluster: LocalCluster, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    target = tmp_path / "elsewhere"
    target.write_bytes(b"must stay")
    (out / ".big.gpud-partial").symlink_to(target)  # planted where the client writes first
    with Client(cluster.frontend, timeout=60) as c:
        with pytest.raises(InvalidRequest, match="outputs_to: cannot write"):
            c.run(["sh", "-c", f"head -c {20 * MiB} /dev/zero > big; echo x > little"], outputs=["big", "little"],
                  outputs_to=out, gpu_milli=100)
    assert target.read_bytes() == b"must stay"
    assert sorted(p.name for p in out.iterdir()) == [".big.gpud-partial"]  # the link, and nothing that looks whole


CLIENT = """
import hashlib, json, sys, threading, time
from pathlib import Path
from gpud_client import Client

def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024

endpoint, src, out, nbytes = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
peak, stop = [0], threading.Event()
def sample():
    while not stop.wait(0.005):
        peak[0] = max(peak[0], anon())
with Client(endpoint, timeout=120) as c:
    c.echo(b"warm")  # the connection's own buffers before the baseline
    base = anon()
    t = threading.Thread(target=sample)
    t.start()
    res = c.run(["sh", "-c", f"md5sum in; head -c {nbytes} in > out"], files={"in": src}, outputs=["out"],
                outputs_to=out, gpu_milli=100, time_limit=120, timeout=180)
    stop.set()
    t.join()
print(json.dumps({"code": res.exit_code, "stdout": res.stdout.decode(), "growth": peak[0] - base,
                  "paths": {k: str(v) for k, v in res.paths.items()}}))
"""


def test_the_clients_memory_stays_bounded_whatever_the_sizes(cluster: LocalCluster, tmp_path: Path) -> None:
    src = tmp_path / "in"
    src.write_bytes(data := pattern(BIG, 2))
    digest = hashlib.md5(data).hexdigest()
    del data
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(ROOT / p) for p in ("", "libclient"))}
    proc = subprocess.run([sys.executable, "-c", CLIENT, cluster.frontend, str(src), str(out), str(BIG)],
                          capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["code"] == 0 and got["stdout"].split()[0] == digest
    assert got["paths"] == {"out": str(out / "out")}
    assert hashlib.md5((out / "out").read_bytes()).hexdigest() == digest
    assert got["growth"] < ANON_BOUND, f"the client's anonymous memory grew {got['growth'] >> 20} MiB"
