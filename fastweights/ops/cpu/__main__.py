"""``python -m fastweights.ops.cpu [-v]``: build (or find) the compiled CPU kernels now, then say
which path each op takes on the CPU and which instruction-set path each kernel runs, and why
(``make setup`` runs it; so does the install check).

Each op is run once on a tiny fp32 input while the compiled module is watched, so the table is
what the calls did, not what they are meant to do: ``compiled (chunk_delta_fwd, ...)`` names the
kernel entry points a call reached; ``PyTorch path`` means it reached none.
"""

import sys

import torch

import fastweights.ops.cpu as package


class _Watch:
    """Stands in for the compiled module and notes every entry point fetched from it."""

    def __init__(self, module) -> None:
        self._module, self.used = module, []

    def __getattr__(self, name):
        self.used.append(name)
        return getattr(self._module, name)


def _probes():
    """``(name, call)`` pairs: each call runs one op on the CPU in fp32, backward where it has one."""
    from fastweights import ops
    from fastweights.layers.common import causal_conv1d

    g = torch.Generator().manual_seed(0)

    def x(*shape, grad=True):
        return torch.randn(*shape, generator=g).requires_grad_(grad)

    def delta(**kw):
        q, k, v = x(1, 40, 2, 16), x(1, 40, 2, 16), x(1, 40, 2, 16)
        o, _ = ops.chunk_delta_rule(q, torch.nn.functional.normalize(k, dim=-1), v, torch.rand(1, 40, 2, generator=g), **kw)
        o.sum().backward()

    def gated():
        q, k, v = x(1, 40, 2, 16), x(1, 40, 2, 16), x(1, 40, 2, 16)
        g_log = -torch.rand(1, 40, 2, generator=g)
        o, _ = ops.chunk_gated_delta_rule(q, torch.nn.functional.normalize(k, dim=-1), v, g_log, torch.rand(1, 40, 2, generator=g))
        o.sum().backward()

    def bf16():
        q, k, v = (x(1, 40, 2, 16, grad=False).bfloat16() for _ in range(3))
        with torch.no_grad(), ops.bf16_products():
            ops.chunk_delta_rule(q, torch.nn.functional.normalize(k.float(), dim=-1).bfloat16(), v, torch.rand(1, 40, 2, generator=g))

    def step(gated_step):
        q, k, v = (x(1, 2, 16, grad=False) for _ in range(3))
        state, beta = torch.zeros(1, 2, 16, 16), torch.rand(1, 2, generator=g)
        with torch.no_grad():
            if gated_step:
                ops.gated_delta_rule_step(q, k, v, beta, -torch.rand(1, 2, generator=g), state)
            else:
                ops.delta_rule_step(q, k, v, beta, state)

    def kda():
        q, k, v = x(1, 40, 2, 16), x(1, 40, 2, 16), x(1, 40, 2, 16)
        gk = -torch.rand(1, 40, 2, 16, generator=g)
        o, _ = ops.chunk_kda(q, torch.nn.functional.normalize(k, dim=-1), v, gk, torch.rand(1, 40, 2, generator=g))
        o.sum().backward()

    def kda_bf16():
        q, k, v = (x(1, 40, 2, 16, grad=False).bfloat16() for _ in range(3))
        gk = -torch.rand(1, 40, 2, 16, generator=g)
        with torch.no_grad(), ops.bf16_products():
            ops.chunk_kda(q, torch.nn.functional.normalize(k.float(), dim=-1).bfloat16(), v, gk,
                          torch.rand(1, 40, 2, generator=g))

    def gdn2():
        q, k, v = x(1, 40, 2, 16), x(1, 40, 2, 16), x(1, 40, 2, 16)
        gk = -torch.rand(1, 40, 2, 16, generator=g)
        b, w = (torch.rand(1, 40, 2, 16, generator=g) for _ in range(2))
        o, _ = ops.chunk_gdn2(q, torch.nn.functional.normalize(k, dim=-1), v, gk, b=b, w=w)
        o.sum().backward()

    def linear():
        q, k, v = x(1, 40, 2, 16), x(1, 40, 2, 16), x(1, 40, 2, 16)
        ops.chunk_linear_attn(q, k, v, normalize=False)[0].sum().backward()

    def kda_decode():
        q, k, v = (x(1, 2, 16, grad=False) for _ in range(3))
        with torch.no_grad():
            ops.kda_step(q, k, v, torch.rand(1, 2, generator=g), -torch.rand(1, 2, 16, generator=g), torch.zeros(1, 2, 16, 16), 0.25)

    def conv():
        causal_conv1d(x(1, 40, 8), x(8, 4)).sum().backward()

    return [
        ("chunk_delta_rule (forward + backward)", delta),
        ("chunk_gated_delta_rule (forward + backward)", gated),
        ("chunk_delta_rule, use_qk_l2norm_in_kernel", lambda: delta(use_qk_l2norm_in_kernel=True)),
        ("chunk_delta_rule, bf16 products (inference)", bf16),
        ("delta_rule_step", lambda: step(False)),
        ("gated_delta_rule_step", lambda: step(True)),
        ("chunk_kda (forward + backward)", kda),
        ("chunk_kda, bf16 products (inference)", kda_bf16),
        ("chunk_gdn2 (forward + backward)", gdn2),
        ("chunk_linear_attn (forward + backward)", linear),
        ("kda_step", kda_decode),
        ("causal_conv1d (the layers' short convolution)", conv),
    ]


def report() -> int:
    """Print the status line and the path each op takes; 1 when the kernels are on but could not be
    loaded or a probe failed, else 0."""
    module = package.kernels()  # the module the calls may use (None: off, or the build failed)
    loaded = package._module     # what the package holds, put back after each probe (also when turned off)
    print(package.status())
    failed = False
    for name, call in _probes():
        watch = _Watch(module) if module is not None else None
        if watch is not None:
            package._module = watch  # kernels_for() hands out the watcher
        try:
            call()
            used = sorted(set(watch.used)) if watch is not None else []
            line = f"compiled ({', '.join(used)})" if used else "PyTorch path"
        except Exception as exc:  # a probe that fails is reported, not hidden
            failed, line = True, f"error: {type(exc).__name__}: {exc}"
        finally:
            package._module = loaded
        print(f"  {name:<46} {line}")
    return 1 if (module is None and package.enabled()) or failed else 0


if __name__ == "__main__":
    package.build(verbose="-v" in sys.argv)
    code = report()
    print("instruction-set path of each kernel, and why:")
    for kernel, path in package.kernel_report().items():
        print(f"  {kernel}: {path}")
    sys.exit(code)
