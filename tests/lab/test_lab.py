"""``fastweights lab``: every endpoint's numbers against the ops, and the server's answers to bad input.

The numbers the page draws are the ones these endpoints return; each is checked
against the recurrent reference ops (or a direct solve), computed here
independently of the lab's own code path. The HTTP tests run a real server on a
free local port: bad input gets a 4xx with a message, never a traceback or a hang.
"""

import json
import math
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from fastweights import ops
from fastweights.studies import worked_examples as examples
from fastweights.lab import compute, server
from fastweights.lab.params import LabInputError, parse
from fastweights.studies import costs
from fastweights.studies.capacity import weighted_least_squares


def run(panel, **fields):
    table, fn, _ = compute.PANELS[panel]
    return fn(parse(fields, table, panel))


def seq(x):
    """``[N, D]`` -> ``[1, N, 1, D]``."""
    return x[None, :, None]


# ---------------------------------------------------------------------------
# 1. interference


def test_interference_seed_example_is_the_text():
    r = run("interference", **compute.INTERFERENCE_EXAMPLE)
    s = examples.linear_attention_examples()
    print("S after two writes:", r["heat"]["matrix"], "reads:", r["reads"])
    assert r["heat"]["matrix"] == s[0].expected.tolist() == [[3, 1], [-2, 4]]
    assert r["reads"] == [[3, 1], [-2, 4]]  # k₁ and k₂ read back v₁ and v₂ exactly
    assert r["recall"] == 1.0 and r["error"] == 0.0
    three = run("interference", **dict(compute.INTERFERENCE_EXAMPLE, n=3))
    assert three["heat"]["matrix"] == [[3, -3], [-2, 1]]  # "S becomes [[3, -3], [-2, 1]]"
    assert three["reads"] == [[3, -3], [-2, 1], [1.2, -1.8]]
    assert all(e["ok"] for e in r["worked"]["linear_attention"])


def _reference_state(rule, keys, values, p):
    """The memory after the writes, by the float64 recurrent reference ops (or a direct least-squares solve)."""
    k, v = seq(keys), seq(values)
    beta = torch.full((1, len(keys), 1), p["beta"], dtype=torch.float64)
    if rule == "sum":
        return ops.recurrent_linear_attn(k, k, v, scale=1.0, output_final_state=True)[1][0, 0]
    if rule == "delta":
        return ops.recurrent_delta_rule(k, k, v, beta, scale=1.0, output_final_state=True)[1][0, 0]
    if rule == "gated_delta":
        g = torch.full_like(beta, math.log(p["alpha"]))
        return ops.recurrent_gated_delta_rule(k, k, v, g, beta, scale=1.0, output_final_state=True)[1][0, 0]
    if rule == "rls":
        return weighted_least_squares(keys[None], values[None], 1.0, compute.RLS_RIDGE)[0]
    raise AssertionError(rule)


def _reference_reads(rule, keys, values, p):
    if rule == "softmax":  # each stored key reads over all N rows: the definition, one query at a time
        n = len(keys)
        q = seq(torch.cat([keys, keys]))
        k = seq(torch.cat([keys, torch.zeros_like(keys)]))
        v = seq(torch.cat([values, torch.zeros_like(values)]))
        return ops.softmax_attn_reference(q, k, v, scale=p["sharpness"])[0, n:, 0]
    return keys @ _reference_state(rule, keys, values, p)


CASES = [
    dict(rule="sum", n=12, d=8, geometry="random"),
    dict(rule="delta", n=13, d=8, geometry="random", beta=0.6, order="reverse"),
    dict(rule="gated_delta", n=9, d=6, geometry="correlated", cosine=0.7, alpha=0.9, order="shuffled"),
    dict(rule="softmax", n=20, d=5, geometry="random", sharpness=7.0),
    dict(rule="rls", n=7, d=8, geometry="orthogonal"),
    dict(rule="delta", n=3, d=2, geometry="example", beta=1.0, order="reverse"),
]


@pytest.mark.parametrize("fields", CASES, ids=[f"{c['rule']}-{c['geometry']}-N{c['n']}-d{c['d']}" for c in CASES])
def test_interference_numbers_are_the_reference_ops(fields):
    r = run("interference", seed=3, **fields)
    p = parse(dict(fields, seed=3), compute.INTERFERENCE, "interference")
    pool = compute._pairs(p, r["curve"][-1]["n"])
    n = fields["n"]
    keys, values = pool["keys"][0, :n], pool["values"][0, :n]
    order = compute._write_order(p, n)
    reads = torch.empty_like(values)
    reads[order] = _reference_reads(fields["rule"], keys[order], values[order], p)
    err = (reads - values).norm(dim=-1)
    shown = torch.tensor([q["error"] for q in r["pairs"]], dtype=torch.float64)
    hit = (reads @ values.T).argmax(-1) == torch.arange(n)
    print(f"{fields}: max |per-pair error - reference| {(shown - err).abs().max().item():.2e}; recall {r['recall']:.3f}")
    assert torch.allclose(shown, err, atol=1e-8, rtol=0)
    assert [q["recalled"] for q in r["pairs"]] == hit.tolist()
    assert [q["written"] for q in r["pairs"]] == (torch.argsort(order) + 1).tolist()
    if fields["rule"] != "softmax":
        state = _reference_state(fields["rule"], keys[order], values[order], p)
        shown_state = torch.tensor(r["heat"]["matrix"], dtype=torch.float64)
        assert torch.allclose(shown_state, state, atol=1e-4, rtol=0)  # the heat map is rounded to 4 places
    assert next(c for c in r["curve"] if c["n"] == n)["recall"] == r["recall"]


def test_interference_recall_drops_past_d():
    d = 16
    r = run("interference", n=4 * d, d=d, rule="sum")
    by_n = {c["n"]: c["recall"] for c in r["curve"]}
    print("recall by N:", {n: round(x, 3) for n, x in by_n.items()})
    assert min(x for n, x in by_n.items() if n <= d // 2) > 0.95
    assert by_n[4 * d] < 0.6


@pytest.mark.parametrize("rule, w, k1, k2", [
    ("delta", [[9.8, 3], [3.6, 7]], [9.8, 3.6], [3, 7]),  # Schlag et al. 2021, β = 0.8
    ("sum", [[16, 3], [6, 7]], [16, 6], [3, 7]),  # "sum rule instead: W k₁ = (16, 6)"
    ("rls", None, [8, 3], [3, 7]),  # the least-squares fit of two observations of k₁: their mean
])
def test_overwrite_example(rule, w, k1, k2):
    o = run("interference", **dict(compute.INTERFERENCE_EXAMPLE, rule=rule))["worked"]["overwrite"]
    print(rule, o)
    if w is not None:
        assert o["W"] == w
    assert o["read_k1"] == pytest.approx(k1, abs=1e-5) and o["read_k2"] == pytest.approx(k2, abs=1e-5)
    text = {e["name"]: e for e in run("interference")["worked"]["delta_rule"]}
    assert all(e["ok"] for e in text.values())


def test_overwrite_gated_and_softmax():
    g = run("interference", rule="gated_delta", alpha=0.5, beta=0.8)["worked"]["overwrite"]
    w0 = examples.write("sum", [(1, 0), (0, 1)], [(5, 2), (3, 7)])
    ref = examples.write("gated_delta", [(1, 0)], [(11, 4)], beta=[0.8], g=[math.log(0.5)], state=w0)
    assert torch.allclose(torch.tensor(g["W"], dtype=torch.float64), ref.T, atol=1e-6)
    s = run("interference", rule="softmax", sharpness=50.0)["worked"]["overwrite"]
    print("softmax, two rows under k₁:", s["read_k1"])
    assert s["W"] is None and s["read_k1"] == pytest.approx([8, 3], abs=1e-6)  # half old, half new


# ---------------------------------------------------------------------------
# 2. geometry, 3. spotlight, 4. memory


def test_geometry_frames_are_the_ops():
    r = run("geometry")
    keys = [list(k) for k, _ in examples.FAST_WEIGHT_PAIRS] + [list(examples.OVERWRITE["key"])]
    vals = [list(v) for _, v in examples.FAST_WEIGHT_PAIRS] + [list(examples.OVERWRITE["value"])]
    beta = examples.OVERWRITE["beta"]
    t = torch.tensor
    k, v = seq(t(keys, dtype=torch.float64)), seq(t(vals, dtype=torch.float64))
    b = torch.full((1, len(keys), 1), beta, dtype=torch.float64)
    _, h_sum = ops.recurrent_linear_attn(k, k, v, scale=1.0, output_final_state=True)
    _, h_delta = ops.recurrent_delta_rule(k, k, v, b, scale=1.0, output_final_state=True)
    last = r["frames"][-1]
    assert torch.allclose(t(last["W"]["sum"], dtype=torch.float64), h_sum[0, 0].T, atol=1e-9)
    assert torch.allclose(t(last["W"]["delta"], dtype=torch.float64), h_delta[0, 0].T, atol=1e-9)
    assert r["frames"][2]["W"]["sum"] == [[5, 3], [2, 7]]  # Schlag et al. 2021
    assert r["frames"][3]["reads"]["sum"][0] == pytest.approx([10.4, 2.6])  # ch. 3 crosstalk
    # the Householder picture: k = (1, 0), β = 1 maps (3, 5) to (0, 5) (Yang et al. 2024)
    h = run("geometry", keys=[[1, 0]], values=[[0, 0]], beta=1.0, probe=[[3, 5]])["frames"][1]["householder"]
    print("householder:", h["matrix"], h["probe_image"])
    assert h["matrix"] == [[0, 0], [0, 1]] and h["probe_image"] == [0, 5]
    # with β = 1 and |k| = 1 the unit circle collapses onto the line ⟂ k: a projection
    assert max(abs(x) for x, _ in h["circle_image"]) < 1e-12


def test_spotlight_weights_are_the_kernels():
    r = run("spotlight", t=10, d=6, target=3, sharpness=5.0, nu=2, features=16, seed=1)
    gen = torch.Generator().manual_seed(1)
    from fastweights.studies.capacity import unit_vectors
    keys = unit_vectors((10, 6), gen)
    query = torch.nn.functional.normalize(keys[3] + 0.3 * torch.randn(6, generator=gen, dtype=torch.float64), dim=0)
    want = {"softmax": torch.softmax(5.0 * keys @ query, 0), "identity": keys @ query}
    for name, fmap in (("elu", ops.EluPlusOne()), ("dpfp", ops.DPFP(2)),
                       ("favor+", ops.FavorPlus(6, 16, seed=1, input_scale=math.sqrt(5.0)))):
        s = fmap(keys) @ fmap(query)
        want[name] = s / s.sum()
    for m in r["methods"]:
        got = torch.tensor(m["weights"], dtype=torch.float64)
        err = (got - want[m["kind"]]).abs().max().item()
        print(f"{m['kind']}: max |weight - kernel| {err:.1e}, target share {m['target_share']:.3f}")
        assert err < 1e-6
    shares = {m["kind"]: m["target_share"] for m in r["methods"]}
    sharp = run("spotlight", t=10, d=6, target=3, sharpness=60.0, nu=2, features=16, seed=1)
    assert sharp["methods"][0]["target_share"] > shares["softmax"]  # the spotlight narrows as sharpness grows


def test_memory_equals_study_costs():
    # the calculator `fastweights study costs` reports with its default options, built by its own parser
    from fastweights.cli import build_parser
    from fastweights.studies.costs import config_from_args

    args = build_parser().parse_args(["study", "costs"])
    study = costs.calculator(config_from_args(args))
    lab = run("memory")
    assert lab["calculator"] == json.loads(json.dumps(study))
    # and the study's run writes the same calculator into costs.json
    result = costs.run_costs(costs.CostsConfig(contexts=(8,), repeats=1, check_lm=False), progress=False, plots=False)
    assert lab["calculator"] == json.loads(json.dumps(result["calculator"]))
    r = run("memory", layers=24, heads=8, head_dim_k=64, head_dim_v=96, kv_dtype="float16", state_dtype="bfloat16",
            softmax_layers=3, context=50_000, sessions=7, budget_gib=24.0)
    mem = costs.memory_per_session(50_000, 24, 8, 64, 96, "float16", "bfloat16", 3)
    print("one session:", mem, "sessions that fit:", {k: r["current"][f"{k}_sessions"] for k in mem})
    for k, v in mem.items():
        assert r["current"][f"{k}_bytes"] == v
        assert r["current"][f"{k}_sessions"] == int(24 * 2**30 // v)
        assert r["total_bytes"][k] == 7 * v and r["fits"][k] == (7 * v <= 24 * 2**30)


# ---------------------------------------------------------------------------
# bad input, in-process


@pytest.mark.parametrize("panel, fields, words", [
    ("interference", {"n": 0}, "`n` must be in [1, 256]"),
    ("interference", {"d": 10**6}, "`d` must be in [1, 64]"),
    ("interference", {"n": float("nan")}, "`n` must be"),
    ("interference", {"beta": float("inf")}, "finite"),
    ("interference", {"rule": "hebb"}, "`rule` must be one of sum, delta, gated_delta, softmax, rls"),
    ("interference", {"n": "12"}, "`n` must be an integer"),
    ("interference", {"n": 9, "d": 8, "geometry": "orthogonal"}, "`n` <= `d`"),
    ("interference", {"d": 3, "geometry": "example"}, "d = 2"),
    ("interference", {"size": 3}, "unknown field"),
    ("geometry", {"keys": [[1, 0], [0, 1]], "values": [[1, 0]]}, "same length"),
    ("geometry", {"keys": [[1, 0, 2]]}, "`keys[0]` must be a list of 2 numbers"),
    ("spotlight", {"t": 4, "target": 9}, "`target`"),
    ("memory", {"layers": 4, "softmax_layers": 9}, "softmax_layers"),
    ("memory", {"kv_dtype": "float8"}, "`kv_dtype` must be one of"),
    ("tracking", {"bits": "01201"}, "`bits` must be 1 to 512 characters 0 or 1"),
    ("tracking", {"bits": "1" * 513}, "`bits` must be 1 to 512"),
    ("tracking", {"bits": 101}, "`bits` must be a string of 0s and 1s"),
    ("tracking", {"arm": "linear"}, "`arm` must be one of"),
], ids=lambda x: x if isinstance(x, str) and len(x) < 14 else None)
def test_bad_fields_name_the_field(panel, fields, words):
    with pytest.raises(LabInputError) as info:
        run(panel, **fields)
    print(info.value)
    assert words in str(info.value) and str(info.value).startswith(panel)


# ---------------------------------------------------------------------------
# the HTTP server


@pytest.fixture(scope="module")
def lab_url():
    srv = server.make_server("127.0.0.1", 0)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield server.url_of(srv)
    srv.shutdown()
    srv.server_close()


def http(url, path, body=None, raw=None, method=None, timeout=10):
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url.rstrip("/") + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as res:
            return res.status, res.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_http_page_config_and_panels(lab_url):
    status, page = http(lab_url, "/")
    assert status == 200 and b"fastweights lab" in page
    for name in server.STATIC:
        assert http(lab_url, f"/static/{name}")[0] == 200
    status, cfg = http(lab_url, "/api/config")
    cfg = json.loads(cfg)
    assert set(cfg) == set(compute.PANELS) and all(c["passage"] for c in cfg.values())
    for panel in compute.PANELS:
        status, body = http(lab_url, f"/api/{panel}", {})
        answer = json.loads(body)
        answer.pop("compute_ms")
        assert status == 200 and answer == json.loads(json.dumps(run(panel))), panel


@pytest.mark.parametrize("raw, status, words", [
    (b'{"n": 0}', 400, "`n` must be in [1, 256]"),
    (b'{"d": 1000000}', 400, "`d` must be in [1, 64]"),
    (b'{"n": NaN}', 400, "NaN"),
    (b'{"beta": Infinity}', 400, "Infinity"),
    (b'{"rule": "hebb"}', 400, "`rule` must be one of"),
    (b'{"n": ', 400, "not valid JSON"),
    (b'[1, 2]', 400, "must be a JSON object"),
    (b'\xff\xfe', 400, "not valid JSON"),
], ids=["N=0", "d=1e6", "NaN", "Infinity", "unknown-rule", "truncated-json", "not-an-object", "not-utf8"])
def test_http_bad_input_is_a_400_with_a_message(lab_url, raw, status, words):
    got, body = http(lab_url, "/api/interference", raw=raw)
    message = json.loads(body)["error"]
    print(got, message)
    assert got == status and words in message and "Traceback" not in message


def test_http_unknown_paths_and_oversized_body(lab_url):
    got, body = http(lab_url, "/api/nope", {})
    assert got == 404 and "interference" in json.loads(body)["error"]
    assert http(lab_url, "/etc/passwd")[0] == 404
    assert http(lab_url, "/static/../server.py")[0] == 404
    got, body = http(lab_url, "/api/interference", raw=b" " * (server.MAX_BODY + 1))
    print(got, body)
    assert got == 413 and str(server.MAX_BODY) in json.loads(body)["error"]


def _raw_exchange(url, chunks, pause):
    host, port = url.split("//")[1].strip("/").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        for chunk in chunks:
            sock.sendall(chunk)
            time.sleep(pause)
        return sock.recv(65536)


@pytest.mark.parametrize("chunks", [
    [b"POST /api/interference HTTP/1.0\r\nContent-Length: 40\r\n\r\n{\"n\": "],  # body never completes
    [b"GET / HT"],  # request line never completes
], ids=["slow-body", "slow-request-line"])
def test_http_slow_request_gets_408_and_server_stays_up(lab_url, chunks, monkeypatch):
    monkeypatch.setattr(server, "REQUEST_TIMEOUT", 0.5)
    start = time.perf_counter()
    done = {}
    t = threading.Thread(target=lambda: done.setdefault("reply", _raw_exchange(lab_url, chunks, 0.0)))
    t.start()
    time.sleep(0.1)
    # another client is served while the slow one holds its connection
    assert http(lab_url, "/api/memory", {})[0] == 200
    t.join(10)
    waited = time.perf_counter() - start
    reply = done.get("reply", b"")
    print(f"slow client answered after {waited:.2f} s: {reply[:80]!r}")
    assert reply.startswith(b"HTTP/1.0 408") and b"did not arrive within" in reply
    assert waited < 5


def test_largest_requests_are_bounded_in_time(lab_url):
    biggest = {
        "interference": {"n": 256, "d": 64, "rule": "rls", "order": "shuffled"},
        "geometry": {"keys": [[1, 2]] * 8, "values": [[3, 4]] * 8},
        "spotlight": {"t": 64, "d": 64, "features": 256, "nu": 3, "target": 63},
        "memory": {"context": 2**30, "layers": 1024, "heads": 1024, "head_dim_k": 4096, "head_dim_v": 4096,
                   "softmax_layers": 1024},
        "tracking": {"bits": "10" * 256},
    }
    for panel, fields in biggest.items():
        start = time.perf_counter()
        status, body = http(lab_url, f"/api/{panel}", fields, timeout=30)
        took = time.perf_counter() - start
        print(f"{panel}: largest request {took * 1e3:.0f} ms, {len(body)} bytes")
        assert status == 200 and took < 10


def test_cli_prints_url_and_serves():
    proc = subprocess.Popen([sys.executable, "-m", "fastweights.cli", "lab", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        print(line)
        url = line.split("serving on ")[1].split()[0]
        assert url.startswith("http://127.0.0.1:")
        assert http(url, "/api/config")[0] == 200
    finally:
        proc.terminate()
        proc.wait(10)


def test_cli_bad_port_is_a_message(capsys):
    from fastweights.cli import main

    with pytest.raises(SystemExit) as info:
        main(["lab", "--port", "70000"])
    err = capsys.readouterr().err
    print(err)
    assert info.value.code == 2 and "`--port` must be in [0, 65535], got 70000" in err


@pytest.mark.parametrize("request_bytes, status", [
    (b"GARBAGE\r\n\r\n", 400),  # not an HTTP request line
    (b'GET / HTTP/9"x\r\n\r\n', 400),  # a quote in the message must not break the JSON
    (b"PUT /api/memory HTTP/1.0\r\nContent-Length: 2\r\n\r\n{}", 501),
], ids=["garbage", "bad-version", "PUT"])
def test_http_malformed_requests_get_json_errors(lab_url, request_bytes, status):
    reply = _raw_exchange(lab_url, [request_bytes], 0.2)
    head, _, body = reply.partition(b"\r\n\r\n")
    print(head.split(b"\r\n")[0], body)
    assert head.startswith(f"HTTP/1.0 {status}".encode()) and json.loads(body)["error"].startswith(str(status))


def test_geometry_seed_is_the_earlier_name_of_example():
    """Requests written before the worked example's geometry was renamed still get its numbers."""
    old = run("interference", rule="delta", n=3, d=2, geometry="seed", beta=1.0)
    new = run("interference", rule="delta", n=3, d=2, geometry="example", beta=1.0)
    assert old == new
    with pytest.raises(LabInputError, match="`geometry` must be one of"):
        parse({"geometry": "seeds"}, compute.INTERFERENCE, "interference")


def test_tracking_panel_reads_the_shipped_parity_models():
    """The β ∈ [0, 2] model's 1-bits are reflections (eigenvalue < 0), its 0-bits are not, the sign of the
    running determinant is (−1)^parity at every token, and its answers are right at 4× its training
    length; the β ∈ [0, 1] model has no negative eigenvalue and answers at chance. The numbers are the
    model's own: β is what the layer hands the op, recomputed here from the layer's projections."""
    bits = "".join(str(int(b)) for b in torch.randint(0, 2, (256,), generator=torch.Generator().manual_seed(5)))
    r = run("tracking", bits=bits, arm="deltanet[0,2]")
    eig = torch.tensor(r["eigenvalue"])
    ones = torch.tensor([b == "1" for b in bits])
    print(f"β∈[0,2]: eigenvalues of 1-bits in [{eig[ones].min():.3f}, {eig[ones].max():.3f}], of 0-bits in "
          f"[{eig[~ones].min():.3f}, {eig[~ones].max():.3f}]; token accuracy {r['token_accuracy']}")
    assert bool((eig[ones] < 0).all() and (eig[~ones] > 0).all()) and r["sign_is_parity"]
    assert r["truth"] == [sum(map(int, bits[:t + 1])) % 2 for t in range(len(bits))]
    assert r["token_accuracy"] >= 0.99 and r["train_length"] == 64
    from fastweights.lab import tracking

    model, _ = tracking.load_model("deltanet[0,2]")
    layer = model.blocks[0].mixer
    x = model.embed(torch.tensor([[int(b) for b in bits]]))
    beta = layer.write_and_decay(torch.nn.functional.linear(model.blocks[0].mixer_norm(x), layer.b_proj.weight))[0]
    assert torch.allclose(1 - beta[0, :, 0].double(), eig.double(), atol=1e-6)
    low = run("tracking", bits=bits, arm="deltanet[0,1]")
    print(f"β∈[0,1]: min eigenvalue {min(low['eigenvalue']):.3f}, token accuracy {low['token_accuracy']}")
    assert min(low["eigenvalue"]) >= 0 and not low["sign_is_parity"] and low["token_accuracy"] < 0.65
