"""gpudctl's human output without a terminal: ``render`` (the ``top`` screen) and ``render_result``."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from gpud_client.ctl import render, render_result

GIB = 1 << 30


def status(requests: int = 1000, uptime: float = 100.0, ngpus: int = 4) -> dict[str, Any]:
    return {
        "broker": {"name": "gpud-a", "version": "0.1.0", "uptime_s": uptime, "role": "standalone",
                   "peer": None, "policy": "balanced"},
        "counts": {"workers": 2, "gpus": ngpus, "queued": 7, "running": 3, "sessions": 1, "done": 99},
        "counters": {"requests": requests, "retries": 0, "errors": 0, "bad_messages": 0},
        "gpus": [
            {"worker": f"w{i // 2}", "name": f"w{i // 2}/{i % 2}", "uuid": f"GPU-{i}", "index": i % 2,
             "model": "NVIDIA H200", "mem": 141 * GIB, "mem_used": (35 * i) * GIB, "util": 25.0 * i,
             "temp": 40 + i, "simulated": False, "health": "cordoned" if i == 3 else "ok",
             "granted_milli": 250 * i, "tasks": i, "work": {"job": i} if i else {}}
            for i in range(ngpus)
        ],
    }


def test_eighty_columns_shows_header_and_one_row_per_gpu() -> None:
    lines = render(status(1500, 102.0), status(1000, 100.0), 80, 24)
    assert len(lines) <= 24 and all(len(line) <= 80 for line in lines), lines
    assert lines[0].startswith("gpud top  gpud-a  role standalone  peer none  up 1m42s")
    assert "queue 7" in lines[1] and "running 3" in lines[1] and "req/s 250.0" in lines[1]
    rows = [line for line in lines if line.startswith("w")]
    assert [r.split()[0] for r in rows] == ["w0/0", "w0/1", "w1/0", "w1/1"]
    assert "[######  ]  75%" in rows[3]
    assert "[####    ]" in rows[2] and " 50%" in rows[2]
    assert "70/141" in rows[2] and "cordoned" in rows[3] and "3 job" in rows[3]
    assert " 500 " in rows[2]


def test_first_sample_has_no_rate_and_a_restart_resets_it() -> None:
    assert "req/s -" in render(status(), None, 80, 24)[1]
    assert "req/s -" in render(status(10, 1.0), status(5000, 300.0), 80, 24)[1]


def test_wider_window_grows_the_bars() -> None:
    narrow = render(status(), None, 80, 24)
    wide = render(status(), None, 160, 24)
    assert all(len(line) <= 160 for line in wide)
    assert len(max(wide[4:], key=len)) > len(max(narrow[4:], key=len))


@pytest.mark.parametrize(("width", "height"), [(80, 5), (40, 6), (39, 24), (80, 3), (10, 1), (0, 0)])
def test_small_windows_never_overflow(width: int, height: int) -> None:
    lines = render(status(ngpus=40), status(ngpus=40), width, height)
    assert len(lines) <= height and all(len(line) <= max(width, 0) for line in lines)


def test_too_many_gpus_says_how_many_are_hidden() -> None:
    lines = render(status(ngpus=40), None, 80, 10)
    assert len(lines) == 10 and lines[-1].startswith("... 35 more GPU(s)")


def test_broker_not_answering_keeps_the_last_rows() -> None:
    lines = render(None, status(), 80, 24)
    assert "broker not answering" in lines[0] and "gpud-a" in lines[0]
    assert sum(line.startswith("w") for line in lines) == 4
    lines = render(None, None, 80, 24)
    assert "broker not answering" in lines[0] and len(lines) <= 24


def test_odd_status_does_not_crash() -> None:
    odd = copy.deepcopy(status())
    odd["gpus"] = [{"util": "high", "mem": -1, "mem_used": None, "work": ["x"], "health": 3}, "junk"]
    odd["broker"] = []
    odd["counters"] = None
    lines = render(odd, {"broker": "x"}, 80, 24)
    assert all(len(line) <= 80 for line in lines)
    assert render({}, None, 80, 24)[-1] == "(no GPUs connected)"


@pytest.mark.parametrize(
    ("cmd", "result"),
    [
        ("status", status()),
        ("gpus", status()["gpus"]),
        ("workers", [{"name": "w" * 40, "hostname": "h" * 40, "gpus": 8, "inflight": 3, "slots": 64,
                      "draining": True, "running": [{}], "last_heard_s": 0.4, "simulated": True}]),
        ("queue", [{"id": "ab" * 16, "kind": "job", "tenant": "t" * 64, "priority": -100, "waited_s": 9999}]),
        ("tasks", {"matched": 3, "tasks": [{"id": "cd" * 16, "state": "running", "kind": "session",
                                            "tenant": "x" * 64, "worker": "w" * 64, "gpus": ["GPU-" + "f" * 36] * 3,
                                            "age_s": 86400 * 3}]}),
        ("sessions", [{"id": "ef" * 16, "tenant": "t", "worker": "w0", "gpu": "GPU-1", "gpu_name": "w0/1",
                       "gpu_milli": 250, "mem": 8 * GIB, "age_s": 3600, "last_seen_s": 2}]),
        ("drain", {"message": "worker w0 drained: " + "x" * 200}),
        ("reload", {"reloaded": True, "result": None}),
        ("queue", "not a list"),
    ],
)
def test_human_output_fits_eighty_columns(cmd: str, result: Any) -> None:
    text = render_result(cmd, result)
    assert text and all(len(line) <= 80 for line in text.splitlines()), text


def test_gpus_table_names_gpus_as_cordon_takes_them() -> None:
    text = render_result("gpus", status()["gpus"])
    assert text.splitlines()[0].split()[:2] == ["GPU", "MODEL"]
    assert text.splitlines()[4].startswith("w1/1") and text.splitlines()[4].rstrip().endswith("cordoned")


def test_status_names_a_pair_members_state_and_epoch() -> None:
    from gpud_client.ctl import format_status

    pair = {"name": "backup", "role": "backup", "state": "active", "epoch": 3, "version": "0.1.0",
            "uptime_s": 5, "policy": "balanced", "peer": "tcp://control-1:5557"}
    first = format_status({"broker": pair, "counts": {}, "gpus": []}).splitlines()[0]
    assert "(backup active e3," in first and len(first) <= 80
    alone = {**pair, "role": "standalone", "state": "active", "peer": None}
    assert "(standalone," in format_status({"broker": alone, "counts": {}, "gpus": []}).splitlines()[0]


def test_status_shows_the_whole_peer_endpoint_and_the_peers_state() -> None:
    from gpud_client.ctl import format_status

    broker = {"name": "backup", "role": "backup", "state": "passive", "epoch": 2, "version": "0.1.0",
              "uptime_s": 5, "policy": "balanced", "peer": "tcp://10.20.30.40:5557"}
    pair = {"peer_state": "active", "peer_silent_s": 0.2, "synced": True}
    lines = format_status({"broker": broker, "pair": pair, "counts": {}, "gpus": []}).splitlines()
    assert "peer tcp://10.20.30.40:5557: active, heard 0s ago" in lines


def test_columns_are_as_wide_as_their_content_and_cut_only_beyond_the_width() -> None:
    long = {"name": "gpu-vm-with-a-long-name-1", "hostname": "h", "gpus": 8, "inflight": 3, "slots": 64,
            "draining": False, "running": [], "last_heard_s": 0.4, "simulated": True}
    text = render_result("workers", [long], width=None)
    assert "gpu-vm-with-a-long-name-1" in text and "~" not in text
    assert len(text.splitlines()[0]) < 80  # narrow content: a narrow table
    narrow = render_result("workers", [long], width=40)
    assert all(len(line) <= 40 for line in narrow.splitlines()) and "~" in narrow


def test_a_suspended_worker_is_shown_suspended_with_its_grace_left() -> None:
    row = {"name": "w1", "hostname": "h", "gpus": 1, "inflight": 1, "slots": 8, "draining": True,
           "suspended": True, "grace_left_s": 7.8, "running": [], "last_heard_s": 4.2}
    lines = render_result("workers", [row, {**row, "name": "w2", "suspended": False, "grace_left_s": None,
                                            "draining": False, "last_heard_s": 0.1}]).splitlines()
    assert "SUSPENDED 7s left" in lines[1] and "draining" not in lines[1]  # its drain is the suspension's
    assert " ok " in lines[2] and "SUSPENDED" not in lines[2]


def test_tasks_name_gpus_as_gpus_does() -> None:
    task = {"id": "cd" * 16, "state": "running", "kind": "job", "tenant": "t", "worker": "gpu-vm-1",
            "gpus": ["SIM-gpu-vm-1-0-0123456789"], "gpu_names": ["gpu-vm-1/0"], "age_s": 3}
    text = render_result("tasks", {"matched": 1, "tasks": [task]}, width=80)
    assert "gpu-vm-1/0" in text and "SIM-gpu" not in text


def test_a_message_is_wrapped_never_cut() -> None:
    message = ("request 0123456789abcdef0123456789abcdef (job, tenant default) cancelled; "
               "its client gets CANCELLED")
    text = render_result("cancel", {"message": message}, width=80)
    assert all(len(line) <= 80 for line in text.splitlines()) and "~" not in text
    assert " ".join(text.split()) == message


def test_queue_shows_needs_and_why() -> None:
    row = {"id": "ab" * 16, "kind": "job", "tenant": "alice", "priority": 0, "waited_s": 12,
           "needs": {"gpus": 2, "mem": 16 * GIB}, "wait": "no_gpu_fits",
           "why": "no GPU fits it now; it goes when enough is free"}
    lines = render_result("queue", [row], width=80).splitlines()
    assert "2 GPUs 16.0G" in lines[1] and "no_gpu_fits" in lines[1]
    assert lines[2].strip() == "why: no GPU fits it now; it goes when enough is free"


def test_output_is_as_wide_as_the_terminal_or_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from gpud_client.ctl import _width

    monkeypatch.delenv("COLUMNS", raising=False)
    assert _width(io.StringIO()) == 80
    monkeypatch.setenv("COLUMNS", "200")
    assert _width(io.StringIO()) == 200


def test_top_shows_the_whole_peer_and_its_state_where_the_window_allows() -> None:
    st = status()
    st["broker"] = {**st["broker"], "role": "primary", "state": "active", "epoch": 2, "peer": "tcp://10.20.30.40:5557"}
    st["pair"] = {"peer_state": "passive"}
    assert "peer tcp://10.20.30.40:5557 (passive)" in render(st, None, 120, 24)[0]
    assert len(render(st, None, 40, 24)[0]) <= 40


def test_status_shows_the_connection_bounds_and_what_is_held() -> None:
    from gpud_client.ctl import format_status

    conns = {"max_connections": 32640, "max_connections_per_source": 1024, "connections": 17, "sources": 3,
             "busiest": {"10.0.0.5": 12}, "refused": {"per_source": 4, "total": 0}, "held_off": ["192.0.2.9"]}
    text = format_status({"broker": {}, "counts": {}, "gpus": [], "connections": conns}, width=None)
    assert ("connections 17 of 32640 (1024 per source) from 3 source(s); refused 4 over a source's bound, 0 over "
            "the total; held off for refused handshakes: 192.0.2.9") in text
    assert "connections" not in format_status({"broker": {}, "counts": {}, "gpus": []}, width=None)
