"""The lab under pathological requests and load: a defined answer or a 4xx naming the field,
never NaN, a 500 or a dropped socket; one request per connection, closed right after the
answer; a burst of 200 concurrent requests served without a reset."""

from __future__ import annotations

import json
import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from fastweights.lab import compute, server
from fastweights.lab.params import LabInputError


@pytest.fixture(scope="module")
def lab():
    srv = server.make_server("127.0.0.1", 0)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    host, port = srv.server_address[:2]
    yield host, port
    srv.shutdown()
    srv.server_close()


def exchange(addr, raw: bytes, timeout=10.0):
    """Send ``raw`` on a fresh connection; read until the server closes it.
    Returns (status, JSON body, seconds until the close)."""
    start = time.perf_counter()
    with socket.create_connection(addr, timeout=timeout) as sock:
        sock.sendall(raw)
        data = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body) if body else None, time.perf_counter() - start, data


def post(addr, panel, body: bytes):
    return exchange(addr, b"POST /api/" + panel.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Length: "
                    + str(len(body)).encode() + b"\r\n\r\n" + body)


def _finite(x):
    return json.loads(json.dumps(x, allow_nan=False)) == x


def test_spotlight_zero_normaliser_is_a_defined_answer_with_a_note(lab):
    # DPFP's features of the query and of both keys do not overlap: φ(q)ᵀφ(k) = 0 for every key
    body = {"t": 2, "d": 2, "noise": 1.0, "seed": 0, "nu": 1, "target": 0}
    status, answer, _, _ = post(lab, "spotlight", json.dumps(body).encode())
    assert status == 200, answer
    dpfp = next(m for m in answer["methods"] if m["kind"] == "dpfp")
    assert dpfp["weights"] == [0.0, 0.0] and "normaliser" in dpfp["note"]
    assert dpfp["target_share"] is None and dpfp["effective_tokens"] is None


def sweep(trials: int, seed: int) -> None:
    """A seeded sweep of in-range values of every panel: a finite JSON answer, or a LabInputError."""
    rng = random.Random(seed)
    small = {"n": 24, "d": 8, "t": 16, "features": 64, "context": 4096}
    for panel, (fields, _fn, _) in compute.PANELS.items():
        for _trial in range(trials):
            body = {}
            for name, f in fields.items():
                if f.kind == "int":
                    hi = min(f.hi, small.get(name, f.hi))
                    body[name] = rng.choice([int(f.lo), int(hi), rng.randint(int(f.lo), int(hi))])
                elif f.kind == "float":
                    body[name] = rng.choice([f.lo, f.hi, rng.uniform(f.lo, f.hi)])
                elif f.kind == "choice":
                    body[name] = rng.choice(list(f.choices))
                elif f.kind == "bool":
                    body[name] = rng.random() < 0.5
            try:
                answer = server.answer(panel, body)
            except LabInputError as e:
                assert "`" in str(e), (panel, body, e)
                continue
            assert _finite(answer), (panel, body)


def test_every_in_range_setting_answers_or_names_a_field():
    sweep(trials=3, seed=0)


@pytest.mark.slow
def test_every_in_range_setting_answers_or_names_a_field_long():
    sweep(trials=100, seed=1)


@pytest.mark.parametrize("body, field", [
    (b'{"geometry": "example", "d": 2, "n": 4}', "`n`"),
    (b'{"n": ' + b"1" * 5000 + b"}", "`n`"),
    (b'{"beta": -' + b"9" * 5000 + b".5}", "`beta`"),
    (b"[" * 30000 + b"]" * 30000, "nest"),
    (b'{"seed": ' + b"[" * 5000 + b"]" * 5000 + b"}", "nest"),
], ids=["example-geometry-N4", "5000-digit-int", "5000-digit-float", "deep-array", "deep-field"])
def test_pathological_bodies_get_a_4xx_naming_the_problem(lab, body, field):
    status, answer, _, _ = post(lab, "interference", body)
    assert 400 <= status < 500 and field in answer["error"], (status, answer)


def test_a_4xx_closes_the_connection_right_after_the_answer(lab):
    for raw in (b"POST /api/interference HTTP/1.1\r\nHost: x\r\nContent-Length: 8\r\n\r\n{\"n\": 0}",
                b"GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n"):
        status, answer, seconds, data = exchange(lab, raw)
        assert status in (400, 404) and data.count(b"HTTP/1.") == 1 and b"408" not in data
        assert seconds < 1.0, seconds


def test_200_concurrent_requests_none_reset_none_slow(lab):
    """A burst: 200 clients connect at once; every one gets its answer within 5 s."""
    def one(i):
        raw = (b"GET /api/config HTTP/1.1\r\nHost: x\r\n\r\n" if i % 2 else
               b"POST /api/memory HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
        start = time.perf_counter()
        try:
            status, _, _, _ = exchange(lab, raw, timeout=10)
        except OSError as e:  # a reset or refused connection
            return type(e).__name__, time.perf_counter() - start
        return status, time.perf_counter() - start

    with ThreadPoolExecutor(max_workers=200) as pool:
        results = list(pool.map(one, range(200)))
    statuses = [s for s, _ in results]
    slowest = max(t for _, t in results)
    print(f"200 concurrent: statuses {sorted(set(map(str, statuses)))}, slowest {slowest:.2f} s")
    assert all(s == 200 for s in statuses), [s for s in statuses if s != 200][:5]
    assert slowest < 5.0
