"""Every number the lab's page shows, computed through ``fastweights.ops`` and the studies.

One function per panel, each taking the cleaned fields of its request (see
``FIELDS``) and returning a JSON-ready dict; the page only draws what these return.

====================  ==========================================================
panel                 computed by
====================  ==========================================================
interference          :func:`fastweights.studies.capacity.read_outs` (the
                      capacity study's write-then-read of every stored key
                      through the chunk ops, softmax_attn or exact RLS), its
                      ``decode``; the state from the same ops'
                      ``output_final_state``; the worked examples from
                      :mod:`fastweights.studies.worked_examples`
geometry (2-D)        ``examples.write``/``examples.read`` (recurrent sum and
                      delta ops), the Householder factor as a delta write of
                      v = 0 into h₀ = I
spotlight/floodlight  ``softmax_attn`` and ``recurrent_linear_attn`` read with
                      one-hot values, so each read-out *is* the weight vector
memory calculator     :func:`fastweights.studies.costs.calculator` (the same
                      function ``fastweights study costs`` reports)
state tracking        :func:`fastweights.lab.tracking.track`: the parity models
                      the state-tracking study's protocol trains, read token by
                      token (β, the transition's eigenvalue, the answer)
====================  ==========================================================

Layouts: the ops keep ``h`` as keys × values. The linear-attention worked example prints its S in that
layout (``S = Σ k vᵀ``); the fast-weight examples print ``W = Σ v kᵀ = hᵀ``. Each panel says which one it
draws, and matches its seed.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List

import torch

from .. import ops
from ..studies import worked_examples as examples
from ..studies import costs as costs_study
from ..studies.capacity import CapacityConfig, decode, read_outs, recursive_least_squares, unit_vectors
from . import tracking
from .params import Field, LabInputError

DTYPE = torch.float64
RULES = ("sum", "delta", "gated_delta", "softmax", "rls")
#: the capacity study's arm that runs each rule of the interference panel
RULE_ARMS = {"sum": "sum", "delta": "delta", "gated_delta": "fading", "softmax": "softmax", "rls": "rls"}
GEOMETRIES = ("random", "correlated", "orthogonal", "example")
ORDERS = ("forward", "reverse", "shuffled")
FEATURE_MAPS = ("identity", "elu", "dpfp", "favor+")
RLS_RIDGE = 1e-6
CURVE_POINTS = 20
#: trials averaged per point of the recall curve (the state and per-pair errors are trial 0's)
TRIALS = 4
MAX_PAIRS = 256
MAX_WIDTH = 64


def _round(x: torch.Tensor, digits: int = 6) -> Any:
    """A tensor as nested lists of floats rounded for the wire (the page prints at most 4 digits)."""
    return torch.round(x.detach().to(DTYPE), decimals=digits).tolist()


# ---------------------------------------------------------------------------
# 1. interference


INTERFERENCE = {
    "n": Field("int", 24, 1, MAX_PAIRS),
    "d": Field("int", 16, 1, MAX_WIDTH),
    "geometry": Field("choice", "random", choices=GEOMETRIES, aliases={"seed": "example"}),  # its earlier name
    "cosine": Field("float", 0.5, 0.0, 0.99),
    "rule": Field("choice", "sum", choices=RULES),
    "beta": Field("float", examples.OVERWRITE["beta"], 0.01, 1.0),
    "alpha": Field("float", 0.95, 0.5, 1.0),
    "sharpness": Field("float", 10.0, 0.1, 1000.0),
    "order": Field("choice", "forward", choices=ORDERS),
    "seed": Field("int", 0, 0, 2**31 - 1),
}
#: "reset to the worked example": the linear-attention worked example's memory, d = 2, its two perpendicular writes
INTERFERENCE_EXAMPLE = {"n": 2, "d": 2, "geometry": "example", "rule": "sum", "order": "forward"}


def _capacity_config(p: Dict) -> CapacityConfig:
    """The capacity study's settings that make its arm run this panel's rule."""
    gamma = 1.0 if p["rule"] == "rls" else p["alpha"]
    return CapacityConfig(eta=p["beta"], gamma=gamma, softmax_scale=p["sharpness"], ridge=RLS_RIDGE)


def _pairs(p: Dict, n_max: int) -> Dict[str, torch.Tensor]:
    """Keys and values ``[R, n_max, d]`` in draw order; point N of the curve stores the first N of each trial."""
    d, geometry = p["d"], p["geometry"]
    if geometry == "example":
        if d != 2 or n_max > len(examples.LINEAR_PAIRS):
            raise LabInputError(f"interference: the worked example (docs/worked_examples.md) has d = 2 and at most "
                                f"{len(examples.LINEAR_PAIRS)} pairs; got d = {d}, N = {p['n']}")
        keys = torch.tensor([k for k, _ in examples.LINEAR_PAIRS], dtype=DTYPE)[None, :n_max]
        values = torch.tensor([v for _, v in examples.LINEAR_PAIRS], dtype=DTYPE)[None, :n_max]
        return {"keys": keys, "values": values}
    gen = torch.Generator().manual_seed(p["seed"])
    values = unit_vectors((TRIALS, n_max, d), gen)
    if geometry == "random":
        keys = unit_vectors((TRIALS, n_max, d), gen)
    elif geometry == "correlated":
        # a shared direction u plus a private one: pairwise cosines near c (exactly c on average as d grows)
        c = p["cosine"]
        shared, private = unit_vectors((TRIALS, 1, d), gen), unit_vectors((TRIALS, n_max, d), gen)
        keys = torch.nn.functional.normalize(math.sqrt(c) * shared + math.sqrt(1 - c) * private, dim=-1)
    else:  # orthogonal: the first N columns of a random orthogonal matrix
        if p["n"] > d:
            raise LabInputError(f"interference: orthogonal keys exist only while `n` <= `d`; got n = {p['n']}, d = {d}")
        q, _ = torch.linalg.qr(torch.randn(TRIALS, d, d, generator=gen, dtype=DTYPE))
        keys = q.transpose(1, 2)[:, :n_max]
    return {"keys": keys, "values": values}


def _write_order(p: Dict, n: int) -> torch.Tensor:
    """Pair indices in the order they are written."""
    if p["order"] == "forward":
        return torch.arange(n)
    if p["order"] == "reverse":
        return torch.arange(n - 1, -1, -1)
    return torch.randperm(n, generator=torch.Generator().manual_seed(p["seed"] * 7919 + n))


def _final_state(rule: str, keys: torch.Tensor, values: torch.Tensor, p: Dict):
    """The memory after writing ``keys [1, N, d]`` -> ``values`` with ``rule``: h [K, V], or the KV cache."""
    k, v = keys[:, :, None], values[:, :, None]
    beta = torch.full(keys.shape[:2] + (1,), p["beta"], dtype=DTYPE)
    if rule == "sum":
        return ops.chunk_linear_attn(k, k, v, scale=1.0, output_final_state=True)[1][0, 0]
    if rule == "delta":
        return ops.chunk_delta_rule(k, k, v, beta, scale=1.0, output_final_state=True)[1][0, 0]
    if rule == "gated_delta":
        g = torch.full_like(beta, math.log(p["alpha"]))
        return ops.chunk_gated_delta_rule(k, k, v, g, beta, scale=1.0, output_final_state=True)[1][0, 0]
    if rule == "rls":
        return recursive_least_squares(keys, values, 1.0, RLS_RIDGE)[0]
    return ops.softmax_attn(k, k, v, scale=p["sharpness"], output_final_state=True)[1]


def _score(p: Dict, pool: Dict[str, torch.Tensor], n: int, config: CapacityConfig):
    """Write the first ``n`` pairs of every trial in write order, read every stored key: reads in draw order."""
    order = _write_order(p, n)
    keys, values = pool["keys"][:, :n], pool["values"][:, :n]
    cell = {"keys": keys[:, order], "values": values[:, order], "priority": torch.zeros(keys.shape[:2], dtype=torch.bool)}
    reads = torch.empty_like(values)
    reads[:, order] = read_outs(RULE_ARMS[p["rule"]], cell, config)
    hit = (decode(reads, values) == torch.arange(n)).to(DTYPE)  # [R, n]
    error = (reads - values).norm(dim=-1)  # [R, n]
    return reads, hit, error, order


def interference(p: Dict) -> Dict:
    """Recall and retrieval error against the number of stored pairs N, at width d (docs/worked_examples.md)."""
    n, d = p["n"], p["d"]
    if p["geometry"] == "example":
        n_max = len(examples.LINEAR_PAIRS)
        if n > n_max or d != 2:
            raise LabInputError(f"interference: the worked example (docs/worked_examples.md) has d = 2 and at most "
                                f"{n_max} pairs; `n` must be in [1, {n_max}] and `d` = 2 there, got n = {n}, d = {d}")
        ns = list(range(1, n_max + 1))
    else:
        n_max = min(MAX_PAIRS, max(2 * d, (3 * n + 1) // 2))  # room on both sides of N and of d
        if p["geometry"] == "orthogonal":
            n_max = d
        grid = torch.linspace(1, n_max, min(CURVE_POINTS, n_max)).round().long().tolist()
        ns = sorted(set(grid) | {n} | ({d} if d <= n_max else set()))
    pool = _pairs(p, n_max)
    config = _capacity_config(p)
    curve = []
    for m in ns:
        reads, hit, error, order = _score(p, pool, m, config)
        curve.append({"n": m, "recall": hit.mean().item(), "error": error.mean().item()})
        if m == n:
            current = {"reads": reads[0], "hit": hit[0], "error": error[0], "order": order}
    keys, values = pool["keys"][:1, :n], pool["values"][:1, :n]
    state = _final_state(p["rule"], keys[:, current["order"]], values[:, current["order"]], p)
    if isinstance(state, ops.KVCache):
        heat = {"title": f"softmax keeps every row: its key cache, N × d = {n} × {d}",
                "rows": "stored pair", "cols": "key coordinate", "matrix": _round(state.keys[0, 0, :n], 4)}
    else:
        heat = {"title": f"state S = Σ k vᵀ (keys × values, the ops' layout), {d} × {d}",
                "rows": "key coordinate", "cols": "value coordinate", "matrix": _round(state, 4)}
    cos = keys[0] @ keys[0].T
    off = cos[~torch.eye(n, dtype=torch.bool)]
    point = next(c for c in curve if c["n"] == n)
    return {
        "n": n, "d": d, "rule": p["rule"], "trials": pool["keys"].shape[0],
        "recall": point["recall"], "error": point["error"],
        "curve": curve,
        "pairs": [{"pair": i + 1, "written": int((current["order"] == i).nonzero()) + 1,
                   "error": current["error"][i].item(), "recalled": bool(current["hit"][i])} for i in range(n)],
        "mean_key_cosine": off.mean().item() if n > 1 else None,
        "max_key_cosine": off.abs().max().item() if n > 1 else None,
        "heat": heat,
        "reads": _round(current["reads"][:8], 6) if d <= 4 else None,
        "worked": worked_examples(p),
    }


def _overwrite(p: Dict) -> Dict:
    """docs/worked_examples.md §2: from W = [[5, 3], [2, 7]], write k₁ -> (11, 4) with the panel's rule."""
    (k1, v1), (k2, v2), _ = examples.FAST_WEIGHT_PAIRS
    over = examples.OVERWRITE
    rule, beta = p["rule"], p["beta"]
    keys, vals = [k1, k2, over["key"]], [v1, v2, over["value"]]
    if rule == "softmax":  # no matrix: the cache holds all three rows; read each key over them
        k = examples._seq(keys)
        reads = []
        for q in (k1, k2):
            o, _ = ops.softmax_attn(examples._seq([q] * 3), k, examples._seq(vals), scale=p["sharpness"])
            reads.append(o[0, -1, 0])
        w = None
    else:
        if rule == "rls":
            h = recursive_least_squares(examples.t(keys)[None], examples.t(vals)[None], 1.0, RLS_RIDGE)[0]
        else:
            w0 = examples.write("sum", keys[:2], vals[:2])
            g = [math.log(p["alpha"])]
            h = {"sum": lambda: examples.write("sum", keys[2:], vals[2:], state=w0),
                 "delta": lambda: examples.write("delta", keys[2:], vals[2:], beta=[beta], state=w0),
                 "gated_delta": lambda: examples.write("gated_delta", keys[2:], vals[2:], beta=[beta], g=g, state=w0),
                 }[rule]()
        reads = [examples.read(h, k1), examples.read(h, k2)]
        w = _round(h.T)
    return {"W": w, "read_k1": _round(reads[0]), "read_k2": _round(reads[1]),
            "key": list(over["key"]), "value": list(over["value"])}


def worked_examples(p: Dict) -> Dict:
    """The worked examples this panel illustrates (text vs ops), and the overwrite under the panel's rule."""
    def rows(items):
        return [{"where": e.where, "name": e.name, "computed": _round(e.computed),
                 "expected": None if e.expected is None else _round(e.expected), "ok": e.ok} for e in items]

    return {
        "linear_attention": rows(examples.linear_attention_examples()),
        "delta_rule": rows(e for e in examples.fast_weight_examples() if e.where == "§2 delta rule"),
        "overwrite": _overwrite(p),
    }


# ---------------------------------------------------------------------------
# 2. 2-D geometry


GEOMETRY = {
    "keys": Field("vectors", [list(k) for k, _ in examples.FAST_WEIGHT_PAIRS] + [list(examples.OVERWRITE["key"])],
                  -20.0, 20.0, width=2, most=8),
    "values": Field("vectors", [list(v) for _, v in examples.FAST_WEIGHT_PAIRS] + [list(examples.OVERWRITE["value"])],
                    -20.0, 20.0, width=2, most=8),
    "beta": Field("float", examples.OVERWRITE["beta"], 0.0, 1.0),
    "probe": Field("vectors", [[3.0, 5.0]], -20.0, 20.0, width=2, most=1),
}
GEOMETRY_EXAMPLE: Dict[str, Any] = {}  # the defaults are the fast-weight worked examples' writes and the probe (3, 5)
CIRCLE = 48


def geometry(p: Dict) -> Dict:
    """Step through the writes in the plane: the sum rule piles up, the delta rule erases along k and writes."""
    keys, values, beta = p["keys"], p["values"], p["beta"]
    if len(keys) != len(values):
        raise LabInputError(f"geometry: `keys` and `values` must have the same length; got {len(keys)} and {len(values)}")
    eye = torch.eye(2, dtype=DTYPE)
    angle = torch.linspace(0, 2 * math.pi, CIRCLE + 1, dtype=DTYPE)
    circle = torch.stack([angle.cos(), angle.sin()], dim=1)  # [CIRCLE+1, 2]
    probe = examples.t(p["probe"][0])
    states = {"sum": torch.zeros(2, 2, dtype=DTYPE), "delta": torch.zeros(2, 2, dtype=DTYPE)}
    frames = [{"step": 0, "W": {r: _round(h.T) for r, h in states.items()},
               "reads": {r: [] for r in states}}]
    for t, (k, v) in enumerate(zip(keys, values)):
        old = examples.read(states["delta"], k)  # W_{t-1} k: what k retrieves before the write
        states = {"sum": examples.write("sum", [k], [v], state=states["sum"]),
                  "delta": examples.write("delta", [k], [v], beta=[beta], state=states["delta"])}
        # the factor multiplying the old memory: a delta write of v = 0 into h₀ = I leaves I − β k kᵀ
        house = examples.write("delta", [k], [(0.0, 0.0)], beta=[beta], state=eye)
        frames.append({
            "step": t + 1, "key": k, "value": v,
            "W": {r: _round(h.T) for r, h in states.items()},
            "reads": {r: [_round(examples.read(h, kk)) for kk in keys[: t + 1]] for r, h in states.items()},
            "delta_parts": {"old_read": _round(old), "erase": _round(-beta * old), "write": _round(beta * examples.t(v))},
            "householder": {"matrix": _round(house), "probe": _round(probe), "probe_image": _round(house @ probe),
                            "circle_image": _round(circle @ house.T, 5),
                            "key_norm": float(examples.t(k).norm())},
        })
    return {"frames": frames, "beta": beta, "circle": _round(circle, 5)}


# ---------------------------------------------------------------------------
# 3. spotlight vs floodlight


SPOTLIGHT = {
    "t": Field("int", 16, 2, 64),
    "d": Field("int", 16, 2, 64),
    "target": Field("int", 5, 0, 63),
    "sharpness": Field("float", 8.0, 0.1, 100.0),
    "noise": Field("float", 0.3, 0.0, 2.0),
    "nu": Field("int", 1, 1, 3),
    "features": Field("int", 32, 1, 256),
    "seed": Field("int", 0, 0, 2**31 - 1),
}
SPOTLIGHT_EXAMPLE: Dict[str, Any] = {}


def _spread(weights: torch.Tensor, target: int) -> Dict[str, Any]:
    """How focused a read is: the target's share of |weight| and the effective number of tokens 1/Σ p²
    (both ``None`` when every weight is 0: there is no share to speak of)."""
    total = weights.abs().sum()
    if total == 0:
        return {"target_share": None, "effective_tokens": None}
    share = weights.abs() / total
    return {"target_share": share[target].item(), "effective_tokens": (1.0 / (share**2).sum()).item()}


ZERO_NORMALISER = ("the normaliser φ(q)ᵀ Σ φ(k) is 0: φ(q) shares no nonzero feature with any key, so the "
                   "normalized read-out is 0/0; it is shown as 0 for every token")


def spotlight(p: Dict) -> Dict:
    """Attention weights of the last query over T stored tokens: softmax vs linear attention per feature map."""
    t, d, target = p["t"], p["d"], p["target"]
    if target >= t:
        raise LabInputError(f"spotlight: `target` must be a token index in [0, t - 1 = {t - 1}], got {target}")
    gen = torch.Generator().manual_seed(p["seed"])
    keys = unit_vectors((t, d), gen)
    query = torch.nn.functional.normalize(keys[target] + p["noise"] * torch.randn(d, generator=gen, dtype=DTYPE), dim=0)
    q = query.expand(t, d)[None, :, None]
    k = keys[None, :, None]
    onehot = torch.eye(t, dtype=DTYPE)[None, :, None]  # value of token τ is e_τ: the read-out is the weight vector
    methods: List[Dict] = []
    o, _ = ops.softmax_attn(q, k, onehot, scale=p["sharpness"])
    methods.append({"name": f"softmax, sharpness {p['sharpness']:g}", "kind": "softmax", "weights": o[0, -1, 0]})
    maps = {
        "identity": ops.Identity(),
        "elu": ops.EluPlusOne(),
        "dpfp": ops.DPFP(p["nu"]),
        # input scale √sharpness: φ(q)ᵀφ(k) estimates exp(sharpness · qᵀk), the softmax kernel beside it
        "favor+": ops.FavorPlus(d, p["features"], seed=p["seed"], input_scale=math.sqrt(p["sharpness"])),
    }
    labels = {"identity": "linear, φ = identity (signed scores)", "elu": "linear, φ = elu + 1",
              "dpfp": f"linear, φ = DPFP ν={p['nu']}",
              "favor+": f"linear, φ = FAVOR+ m={p['features']} (estimates the softmax kernel at this sharpness)"}
    for name, fmap in maps.items():
        # identity scores are signed, so no positive normalizer exists: show φ(q)ᵀφ(k_τ) as they are
        normalize = name != "identity"
        o, _ = ops.recurrent_linear_attn(q, k, onehot, scale=1.0, feature_map=fmap, normalize=normalize, eps=0.0)
        method = {"name": labels[name], "kind": name, "weights": o[0, -1, 0], "feature_dim": fmap.output_dim(d)}
        if normalize:
            # one-hot values: the unnormalized read-out holds the scores φ(q)ᵀφ(k_τ), their sum is the normaliser
            scores, _ = ops.recurrent_linear_attn(q, k, onehot, scale=1.0, feature_map=fmap, normalize=False)
            if scores[0, -1, 0].sum() == 0:
                method["weights"] = torch.zeros(t, dtype=DTYPE)
                method["note"] = ZERO_NORMALISER
        methods.append(method)
    for m in methods:
        m.update(_spread(m["weights"], target))
        m["weights"] = _round(m["weights"])
    return {"t": t, "target": target, "query_key_cosine": _round(keys @ query), "methods": methods}


# ---------------------------------------------------------------------------
# 4. memory calculator


MEMORY = {
    "layers": Field("int", 32, 1, 1024),
    "heads": Field("int", 32, 1, 1024),
    "head_dim_k": Field("int", 128, 1, 4096),
    "head_dim_v": Field("int", 128, 1, 4096),
    "kv_dtype": Field("choice", "bfloat16", choices=tuple(costs_study.DTYPE_BYTES)),
    "state_dtype": Field("choice", "bfloat16", choices=tuple(costs_study.DTYPE_BYTES)),  # = kv_dtype: one precision
    "context": Field("int", 2**17, 1, 2**30),
    "sessions": Field("int", 1, 1, 10**7),
    "budget_gib": Field("float", 80.0, 1e-3, 1e6),
    "softmax_layers": Field("int", 4, 0, 1024),
}
MEMORY_EXAMPLE: Dict[str, Any] = {}  # the defaults are `fastweights study costs`'s


def memory(p: Dict) -> Dict:
    """The memory calculator: KV cache vs fixed state per session, sessions that fit (``study costs``'s numbers)."""
    fields = {k: p[k] for k in ("layers", "heads", "head_dim_k", "head_dim_v", "kv_dtype", "state_dtype",
                                "softmax_layers", "budget_gib")}
    try:
        config = costs_study.CostsConfig(**fields)
    except ValueError as e:
        raise LabInputError(f"memory: {str(e).replace('CostsConfig: ', '')}") from None
    calc = costs_study.calculator(config)
    row = costs_study.calculator_row(config, p["context"])
    budget = config.budget_gib * 2**30
    totals = {k: p["sessions"] * row[f"{k}_bytes"] for k in ("softmax", "fixed_state", "hybrid")}
    return {"calculator": calc, "current": row, "sessions": p["sessions"],
            "total_bytes": totals, "fits": {k: v <= budget for k, v in totals.items()},
            "budget_bytes": budget}


# ---------------------------------------------------------------------------
# the endpoints


TRACKING = {
    "arm": Field("choice", "deltanet[0,2]", choices=tuple(tracking.MODELS)),
    "bits": Field("bits", "0110100110010110" * 4 + "1011", most=512),
}
TRACKING_EXAMPLE: Dict[str, Any] = {}  # the defaults: 68 bits, just past the training length


def state_tracking(p: Dict) -> Dict:
    """The state-tracking panel: a shipped parity model run on the user's bits, token by token."""
    return tracking.track(p["arm"], p["bits"])


PANELS = {
    "interference": (INTERFERENCE, interference, INTERFERENCE_EXAMPLE),
    "geometry": (GEOMETRY, geometry, GEOMETRY_EXAMPLE),
    "spotlight": (SPOTLIGHT, spotlight, SPOTLIGHT_EXAMPLE),
    "memory": (MEMORY, memory, MEMORY_EXAMPLE),
    "tracking": (TRACKING, state_tracking, TRACKING_EXAMPLE),
}

#: the passage each panel illustrates (short quotes credited, or our paraphrase)
PASSAGES = {
    "interference": ("A d × d state holds about d associations cleanly; store more and their traces overlap, so "
                     "every read picks up some of the others (Schlag et al. 2021, on the capacity of linear attention)."),
    "geometry": ("Yang et al. 2024 (our paraphrase): the delta rule multiplies the memory by I − βkkᵀ, which removes "
                 "the component along k and leaves every direction orthogonal to k alone, then writes the new value; "
                 "the sum rule only adds."),
    "spotlight": ("Katharopoulos et al. 2020 (our paraphrase): softmax can act like a spotlight that puts almost all weight on "
                  "one earlier token; additive linear attention is closer to a floodlight that mixes several."),
    "memory": ("A KV cache grows with every token; a fixed state is one d×d matrix per head, whatever the context "
               "length (Katharopoulos et al. 2020)."),
    "tracking": ("Grazzi et al. 2025 (our paraphrase): if every transition of a linear RNN has only non-negative "
                 "eigenvalues, it cannot count parity at every length in finite precision; let the delta rule's β "
                 "reach 2, so that I − βkkᵀ can reflect, and one layer can."),
}
