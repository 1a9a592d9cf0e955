"""GELU for MLX's CPU backend, from multiplies and adds, in two fused kernels.

On x86 Linux, MLX's CPU backend evaluates ``erf``, ``tanh`` and ``exp`` one element at a time (20–50 ns each,
about 40× a multiply), so a BERT encoder's GELU took more device time than its matrix products: 69 ms of a
788 ms pass of 64 sentences through all-MiniLM-L6-v2, in each of its 6 layers. The rational approximations
below (Eigen's float32 ``erf`` and ``tanh``: a clamp, two polynomials and a division) are as accurate as MLX's
own functions (within 4e-7 of the exact values) and far faster.

How they are computed matters as much as what: MLX's ``compile`` fuses at most 11 operations deep, a shapeless
trace adds a broadcast under every operation with a constant (twice the depth), and the C++ compiler gives up
vectorizing a long kernel that holds a ``minimum``. So a GELU here is two kernels, each traced per input shape:

* the clamp (``clip`` of the function's argument): short, vectorized;
* the rest, branch-free: ``x · (½ + y · R(y²))``, the polynomials of ``R`` evaluated as products of their
  quadratic factors (each three operations deep, all of them side by side) instead of Horner's rule (two
  operations deep per coefficient): at most ten operations deep, so one kernel.

For a pass of 20 sentences (20 × 13 × 1,536 values) that is 0.7 ms against 2.5 ms for the Horner form MLX
split into six kernels, four of them reading broadcast constants through its slow strided path.

:func:`use_fast_gelu` swaps a loaded model's ``nn.GELU`` modules for :class:`FastGELU` when the model runs on
the CPU. On a GPU, MLX's kernels are fast already and the model is left alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.nn.layers.activations import GELU
from mlx.nn.layers.base import Module
from mlx.utils import tree_unflatten

# erf(x) = x · P(x²) / Q(x²) on [-4, 4]; past it erf is ±1 in float32. Coefficients highest power first.
_ERF_CLAMP = 4.0
_ERF_P = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06, -5.69250639462346e-05,
          -7.34990630326855e-04, -2.95459980854025e-03, -1.60960333262415e-02)
_ERF_Q = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03, -7.37332916720468e-03,
          -1.42647390514189e-02)
# tanh(x) = x · P(x²) / Q(x²) on [-7.905, 7.905]; past it tanh is ±1 in float32.
_TANH_CLAMP = 7.90531110763549805
_TANH_P = (-2.76076847742355e-16, 2.00018790482477e-13, -8.60467152213735e-11, 5.12229709037114e-08,
           1.48572235717979e-05, 6.37261928875436e-04, 4.89352455891786e-03)
_TANH_Q = (1.19825839466702e-06, 1.18534705686654e-04, 2.26843463243900e-03, 4.89352518554385e-03)


Factor = tuple[float, ...]  # a monic factor's lower coefficients: (b, c) is t² + b·t + c, (c,) is t + c


def _monic_factors(coefficients: Sequence[float]) -> tuple[float, list[Factor]]:
    """A polynomial (highest power first) as its leading coefficient and its real monic factors: a quadratic
    for each pair of complex roots or of real roots, a linear one for a real root left over."""
    roots = np.roots(np.array(coefficients, dtype=np.float64))
    pairs = [r for r in roots if r.imag > 0]
    real = sorted(float(r.real) for r in roots if r.imag == 0)
    factors: list[Factor] = [(-2 * float(r.real), float(abs(r)) ** 2) for r in pairs]
    factors += [(-(a + b), a * b) for a, b in zip(real[::2], real[1::2])]
    if len(real) % 2:
        factors.append((-real[-1],))
    return float(coefficients[0]), factors


def _product(terms: list[Any]) -> Any:
    """The product of ``terms`` as a balanced tree: log₂(n) operations deep, not n."""
    while len(terms) > 1:
        terms = [terms[i] * terms[i + 1] if i + 1 < len(terms) else terms[i] for i in range(0, len(terms), 2)]
    return terms[0]


class _HalfPlusOddRational:
    """``½ + y · R(y²)`` for ``R = scale · P / Q``, as products of the monic factors of ``P`` and ``Q``: every
    factor is three operations deep and they are evaluated side by side, so ``x · (½ + y · R(y²))`` fits in
    one fused kernel (Horner's rule is two operations deep per coefficient)."""

    def __init__(self, p: Sequence[float], q: Sequence[float], scale: float, clamp: float) -> None:
        lead_p, self.p = _monic_factors(p)
        lead_q, self.q = _monic_factors(q)
        self.scale = scale * lead_p / lead_q
        self._saturate(clamp)

    def _saturate(self, clamp: float) -> None:
        """Nudge the scale by a few float32 ulps so that ``y · R(y²)`` is exactly ±½ at ``y = ±clamp`` in float32:
        Φ is then exactly 0 or 1 past the clamp, and a large negative ``x`` gives GELU's −0, not ``x·3e-8``.
        NumPy's float32 arithmetic, in the kernel's order of operations, gives the kernel's roundings."""
        base, y = self.scale, np.array([clamp], dtype=np.float32)
        for ulps in sorted(range(-16, 17), key=abs):
            self.scale = base * (1 + ulps * 2.0**-24)
            if self.half_rational(y)[0] == 0.5:
                return
        self.scale = base

    @staticmethod
    def _factor(t: Any, factor: Factor) -> Any:
        if len(factor) == 1:
            return t + factor[0]
        return (t + factor[0]) * t + factor[1]

    def half_rational(self, y: Any) -> Any:
        """``y · R(y²)`` of an ``mx.array`` or a float32 ``np.ndarray``."""
        t = y * y
        numerator = _product([self._factor(t, f) for f in self.p] + [y * self.scale])
        return numerator / _product([self._factor(t, f) for f in self.q])

    def __call__(self, x: mx.array, y: mx.array) -> mx.array:
        result: mx.array = (x.astype(mx.float32) * (0.5 + self.half_rational(y))).astype(x.dtype)
        return result


class CompiledPerShape:
    """``mx.compile(fn)``, traced per input shape, for at most ``limit`` shapes at a time. A trace per shape
    keeps the graph shallow (see the module docstring); the kernels themselves do not depend on the shape and
    stay compiled. Past ``limit`` shapes the traces are dropped with the compiled function and begin again, so
    a server that sees every batch size does not keep a trace of each forever."""

    def __init__(self, fn: Callable[..., mx.array], limit: int = 256) -> None:
        self.fn = fn
        self.limit = limit
        self._compiled = mx.compile(fn)
        self._shapes: set[tuple[int, ...]] = set()

    def __call__(self, x: mx.array, *rest: mx.array) -> mx.array:
        if x.shape not in self._shapes:
            if len(self._shapes) >= self.limit:
                self._compiled, self._shapes = mx.compile(self.fn), set()
            self._shapes.add(x.shape)
        result: mx.array = self._compiled(x, *rest)
        return result


# ½·erf and ½·tanh: the rationals every GELU below uses
_HALF_ERF = _HalfPlusOddRational(_ERF_P, _ERF_Q, 0.5, _ERF_CLAMP)
_HALF_TANH = _HalfPlusOddRational(_TANH_P, _TANH_Q, 0.5, _TANH_CLAMP)


def erf(x: mx.array) -> mx.array:
    """erf of float32 ``x``, as GELU computes it (within 5e-7 of the exact values)."""
    return 2 * _HALF_ERF.half_rational(mx.clip(x, -_ERF_CLAMP, _ERF_CLAMP))  # type: ignore[no-any-return]


def tanh(x: mx.array) -> mx.array:
    """tanh of float32 ``x``, as GELU computes it (within 5e-7 of the exact values)."""
    return 2 * _HALF_TANH.half_rational(mx.clip(x, -_TANH_CLAMP, _TANH_CLAMP))  # type: ignore[no-any-return]


class _Gelu:
    """``x · Φ(x)`` where ``Φ(x) = ½ + ½·f(g(x))`` for an odd ``f`` (erf or tanh) and its argument ``g``:
    the clamped argument in one kernel, the rest in another."""

    def __init__(self, argument: Callable[[mx.array], mx.array], clamp: float, half: _HalfPlusOddRational) -> None:
        # float32 inside, whatever the model's dtype: the factors' products pass float16's range (65,504), and
        # bfloat16's 8-bit mantissa would round every step
        self._argument = CompiledPerShape(lambda x: mx.clip(argument(x.astype(mx.float32)), -clamp, clamp))
        self._rest = CompiledPerShape(half)

    def __call__(self, x: mx.array) -> mx.array:
        return self._rest(x, self._argument(x))


_SQRT_2_OVER_PI = math.sqrt(2 / math.pi)
_BY_APPROX = {
    # exact, as nn.gelu: ½ + ½·erf(x / √2)
    "none": _Gelu(lambda x: x * (1 / math.sqrt(2)), _ERF_CLAMP, _HALF_ERF),
    # the tanh approximation, as nn.gelu_approx
    "precise": _Gelu(lambda x: _SQRT_2_OVER_PI * (x + 0.044715 * x * x * x), _TANH_CLAMP, _HALF_TANH),
    # x · σ(1.702 x), as nn.gelu_fast_approx (σ(z) = ½ + ½·tanh(z / 2))
    "fast": _Gelu(lambda x: 0.851 * x, _TANH_CLAMP, _HALF_TANH),
}
_BY_APPROX["tanh"] = _BY_APPROX["precise"]


class FastGELU(Module):
    """``nn.GELU(approx)``'s function, computed from multiplies and adds."""

    def __init__(self, approx: str = "none") -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._function = _BY_APPROX[approx]

    def __call__(self, x: mx.array) -> mx.array:
        return self._function(x)


def use_fast_gelu(model: Module, device: mx.Device | None = None) -> int:
    """Replace the model's ``nn.GELU`` modules by :class:`FastGELU` when ``device`` (default: MLX's default
    device) is the CPU; returns how many were replaced."""
    if (device or mx.default_device()).type != mx.DeviceType.cpu:
        return 0
    modules = model.named_modules()  # type: ignore[no-untyped-call]
    swaps = [(name, FastGELU(getattr(module, "_approx", "none"))) for name, module in modules if type(module) is GELU]
    if swaps:
        model.update_modules(tree_unflatten(swaps))
    return len(swaps)
