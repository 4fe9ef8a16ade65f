"""Feature maps φ and key/query normalizations for the linear and delta ops.

A feature map turns a kernel into a dot product, ``κ(q, k) ≈ φ(q)ᵀφ(k)``, which is
what lets a linear-attention state keep sufficient statistics instead of every
key-value row (Wang, Shi & Fox 2025, solver 2; Schlag et al. 2021). Every map here acts on
the last dimension and keeps the leading ones, so ``[B, T, H, K] -> [B, T, H, D]``
with ``D = map.output_dim(K)``.

========================  =======================================  ==============
name                      φ(x)                                      D
========================  =======================================  ==============
``identity``              x                                         K
``elu``                   elu(x) + 1  (Katharopoulos et al. 2020)  K
``relu``                  relu(x)                                   K
``DPFP(nu)``              concat_j x̃ ⊙ roll(x̃, j), j=1..ν,           2Kν
                          x̃ = [relu(x), relu(-x)] (Schlag 2021)
``FavorPlus(K, m, seed)`` exp(±ωᵀx − |x|²/2)/√(2m)  (Choromanski)   2m
``Taylor()``              [1, x, vec(x xᵀ)/√2]                      1 + K + K²
========================  =======================================  ==============

Normalizations (``qk_norm``), applied after φ:

- ``"l2"``: x·rsqrt(Σx² + 1e-6), the Euclidean norm as fla and transformers compute it (what DeltaNet uses);
- ``"sum"``: divide by the sum of the entries (Schlag et al. 2021, section 4.2),
  meant for nonnegative maps. A vector whose entries sum to ~0 is left as is
  rather than divided by zero.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F

from ..config import check_int
from .cpu import kernels_for
from .cpu import library as cpu_kernels

__all__ = [
    "FeatureMap",
    "Identity",
    "EluPlusOne",
    "ReLU",
    "DPFP",
    "FavorPlus",
    "Taylor",
    "get_feature_map",
    "normalize_qk",
    "QK_NORMS",
]

_EPS = 1e-6
QK_NORMS = (None, "l2", "sum")


class FeatureMap:
    """Base class: a callable ``x[..., K] -> φ(x)[..., D]`` with ``output_dim(K) = D``."""

    name = "feature_map"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def output_dim(self, dim: int) -> int:
        return dim

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Identity(FeatureMap):
    """φ(x) = x: the plain sum rule of Schlag et al. 2021."""

    name = "identity"

    def __call__(self, x):
        return x


class EluPlusOne(FeatureMap):
    """φ(x) = elu(x) + 1 > 0 (Katharopoulos et al. 2020)."""

    name = "elu"

    def __call__(self, x):
        # Written as exp(x) for x <= 0 rather than elu(x) + 1: in fp32, elu(x) + 1
        # rounds to exactly 0 below x ≈ -17, which would zero a normalizer.
        return torch.where(x > 0, x + 1.0, torch.exp(torch.clamp(x, max=0.0)))


class ReLU(FeatureMap):
    """φ(x) = max(x, 0): positive, but with dead gradients for negative inputs (Schlag et al. 2021)."""

    name = "relu"

    def __call__(self, x):
        return F.relu(x)


class DPFP(FeatureMap):
    """Deterministic parameter-free projection, DPFP(ν) (Schlag et al. 2021, eq. 37).

    ``x̃ = [relu(x), relu(−x)]`` (2K entries), then ``φ = concat_{j=1..ν} x̃ ⊙ roll(x̃, j)``,
    so D = 2Kν. Different sign patterns of x light disjoint entries of φ, which is
    how DPFP buys near-orthogonal features from non-orthogonal keys (Schlag et al. 2021).
    """

    name = "dpfp"

    def __init__(self, nu: int = 1) -> None:
        check_int("DPFP", "nu", nu)
        self.nu = nu

    def __call__(self, x):
        x = torch.cat([F.relu(x), F.relu(-x)], dim=-1)
        return torch.cat([x * x.roll(shifts=j, dims=-1) for j in range(1, self.nu + 1)], dim=-1)

    def output_dim(self, dim):
        return 2 * dim * self.nu

    def __repr__(self):
        return f"DPFP(nu={self.nu})"


class FavorPlus(FeatureMap):
    """FAVOR+ positive orthogonal random features (Choromanski et al. 2021).

    ``φ(x) = [exp(ωᵀx − |x|²/2), exp(−ωᵀx − |x|²/2)] / √(2m)`` for m random directions
    ω, so that ``E[φ(q)ᵀφ(k)] = exp(qᵀk)``. The ω are drawn in orthogonal blocks of K,
    each row rescaled to a χ_K-distributed norm (the norm of a standard Gaussian
    vector), from a ``torch.Generator`` seeded with ``seed``: the same seed gives the
    same features on every machine. ``redraw()`` draws fresh ω from the same stream.

    Args:
        dim: K, the input size.
        num_features: m, the number of random directions (D = 2m).
        seed: seed of the projection stream.
        input_scale: x is multiplied by this before projecting; the default
            ``dim ** -0.25`` makes φ(q)ᵀφ(k) estimate the softmax kernel
            ``exp(qᵀk / √K)`` of scaled dot-product attention.
    """

    name = "favor+"

    def __init__(self, dim: int, num_features: Optional[int] = None, seed: int = 0, input_scale: Optional[float] = None):
        check_int("FavorPlus", "dim", dim)
        num_features = dim if num_features is None else num_features
        check_int("FavorPlus", "num_features", num_features)
        self.dim = dim
        self.num_features = num_features
        self.input_scale = dim ** -0.25 if input_scale is None else float(input_scale)
        self._generator = torch.Generator().manual_seed(int(seed))
        self.seed = int(seed)
        self.redraw()

    def redraw(self) -> None:
        """Draw a new projection ω (shape [m, K]) from this map's seeded stream."""
        blocks, left = [], self.num_features
        while left > 0:
            gaussian = torch.randn(self.dim, self.dim, generator=self._generator, dtype=torch.float64)
            q, _ = torch.linalg.qr(gaussian)  # orthonormal columns
            blocks.append(q.T[: min(left, self.dim)])
            left -= self.dim
        omega = torch.cat(blocks, dim=0)
        norms = torch.randn(self.num_features, self.dim, generator=self._generator, dtype=torch.float64).norm(dim=1)
        self.omega = omega * norms[:, None]

    def __call__(self, x):
        x = x * self.input_scale
        omega = self.omega.to(device=x.device, dtype=x.dtype)
        proj = x @ omega.T  # [..., m]
        half_sq = 0.5 * (x * x).sum(-1, keepdim=True)
        # Subtracting |x|²/2 inside the exp keeps the features at the scale of the kernel.
        feats = torch.cat([torch.exp(proj - half_sq), torch.exp(-proj - half_sq)], dim=-1)
        return feats / math.sqrt(2 * self.num_features)

    def output_dim(self, dim):
        return 2 * self.num_features

    def __repr__(self):
        return f"FavorPlus(dim={self.dim}, num_features={self.num_features}, seed={self.seed})"


class Taylor(FeatureMap):
    """Second-order Taylor features: φ(q)ᵀφ(k) = 1 + qᵀk + (qᵀk)²/2 > 0.

    The even-order truncation of exp(qᵀk) (Wang, Shi & Fox 2025) is positive for
    every qᵀk, so it may be used with the normalizer. ``input_scale`` as in
    :class:`FavorPlus`. D = 1 + K + K².
    """

    name = "taylor"

    def __init__(self, input_scale: float = 1.0) -> None:
        self.input_scale = float(input_scale)

    def __call__(self, x):
        x = x * self.input_scale
        outer = (x.unsqueeze(-1) * x.unsqueeze(-2)).flatten(-2) / math.sqrt(2.0)
        return torch.cat([torch.ones_like(x[..., :1]), x, outer], dim=-1)

    def output_dim(self, dim):
        return 1 + dim + dim * dim

    def __repr__(self):
        return f"Taylor(input_scale={self.input_scale})"


_BY_NAME = {
    None: Identity,
    "identity": Identity,
    "elu": EluPlusOne,
    "elu+1": EluPlusOne,
    "relu": ReLU,
    "dpfp": DPFP,
    "taylor": Taylor,
}

FeatureMapLike = Union[None, str, FeatureMap, Callable[[torch.Tensor], torch.Tensor]]


def get_feature_map(spec: FeatureMapLike, op: str = "feature_map") -> FeatureMap:
    """Resolve ``None``/a name/a :class:`FeatureMap` to a feature map object.

    Names: ``identity``, ``elu`` (``elu+1``), ``relu``, ``dpfp`` (ν=1), ``taylor``.
    FAVOR+ carries random state, so pass a :class:`FavorPlus` instance.
    """
    if isinstance(spec, FeatureMap):
        return spec
    if spec is None or isinstance(spec, str):
        key = spec.lower() if isinstance(spec, str) else None
        if key not in _BY_NAME:
            names = ", ".join(repr(n) for n in _BY_NAME if n is not None)
            raise ValueError(f"{op}: unknown `feature_map` {spec!r}; expected one of {names}, or a FeatureMap instance")
        return _BY_NAME[key]()
    raise TypeError(f"{op}: `feature_map` must be None, a name or a FeatureMap instance, got {type(spec).__name__}")


class _L2Norm(torch.autograd.Function):
    """``x · rsqrt(Σx² + ε)`` over the last dim by the compiled kernel; backward ``r · (dy − y (y·dy))``."""

    @staticmethod
    def forward(ctx, x):
        y, r = cpu_kernels.l2norm_fwd(x.contiguous(), _EPS)
        ctx.save_for_backward(y, r)
        return y

    @staticmethod
    def backward(ctx, dy):
        y, r = ctx.saved_tensors
        return cpu_kernels.l2norm_bwd(dy.contiguous(), y, r)


def normalize_qk(x: torch.Tensor, qk_norm: Optional[str], op: str = "normalize_qk", compiled: bool = False) -> torch.Tensor:
    """Apply the ``qk_norm`` normalization (None, ``"l2"`` or ``"sum"``) over the last dim.

    ``compiled=True`` lets the L2 norm run the compiled CPU kernel, whose backward is not itself
    differentiable: for callers that support no double backward anyway (the chunk ops)."""
    if qk_norm is None:
        return x
    if qk_norm == "l2":
        # x·rsqrt(Σx² + ε), the formula of fla's kernels and transformers' fallbacks, so that
        # ``use_qk_l2norm_in_kernel`` gives their numbers (F.normalize's max(‖x‖, ε) differs
        # from it by ~1e-3 relative at small norms). On the CPU the compiled kernel does it in
        # one pass forward and one backward (fastweights/ops/cpu/l2norm.cpp).
        if compiled and x.numel() and kernels_for(x) is not None:
            return _L2Norm.apply(x)
        return x * torch.rsqrt(x.pow(2).sum(dim=-1, keepdim=True) + _EPS)
    if qk_norm == "sum":
        s = x.sum(dim=-1, keepdim=True)
        return x / torch.where(s.abs() < _EPS, torch.ones_like(s), s)
    raise ValueError(f"{op}: unknown `qk_norm` {qk_norm!r}; expected None, 'l2' or 'sum'")
