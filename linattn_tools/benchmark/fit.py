"""Memory against N: least-squares polynomial fits and the longest N that fits in a budget."""
import math
from typing import Dict, List, Sequence


def polyfit(ns: Sequence[float], ys: Sequence[float], degree: int) -> List[float]:
    """Least-squares coefficients c0, c1, ... of y = sum c_i n^i, each point weighted by 1/y (relative error)."""
    import torch

    n = torch.tensor([float(x) for x in ns], dtype=torch.float64) / 1024
    y = torch.tensor([float(v) for v in ys], dtype=torch.float64)
    a = torch.stack([n ** i for i in range(degree + 1)], dim=1) / y[:, None]
    coef = torch.linalg.lstsq(a, torch.ones_like(y)[:, None]).solution[:, 0]
    return [c.item() / 1024 ** i for i, c in enumerate(coef)]


def longest_fitting(coef: Sequence[float], budget: float) -> float:
    """The largest N > 0 with sum c_i N^i <= budget (coefficients of degree 1 or 2, increasing in N)."""
    c = list(coef) + [0.0] * (3 - len(coef))
    c0, c1, c2 = c[0] - budget, c[1], c[2]
    if abs(c2) < 1e-30:
        return -c0 / c1
    return (-c1 + math.sqrt(c1 * c1 - 4 * c2 * c0)) / (2 * c2)


def longest_n(ns: Sequence[int], totals: Sequence[float], budget: float, quadratic: bool) -> Dict:
    """Fit memory ``totals`` (bytes) measured at sizes ``ns`` (increasing) and find the longest N within ``budget``.

    Quadratic through every point (an attention that stores N x N values), else linear through the two
    longest N. Returns {"coef", "n_max", "grid_max" (largest power of two <= n_max), "used" (the sizes
    fitted), "residual" (largest relative error of the fit at the sizes from the first one fitted)};
    n_max is inf and grid_max None when the fitted memory does not grow with N.
    """
    use = list(range(len(ns))) if quadratic else list(range(len(ns)))[-2:]
    coef = polyfit([ns[i] for i in use], [totals[i] for i in use], 2 if quadratic else 1)
    residual = max(abs(sum(c * ns[i] ** j for j, c in enumerate(coef)) / totals[i] - 1)
                   for i in range(use[0], len(ns)))
    grows = coef[-1] > 0
    n_max = longest_fitting(coef, budget) if grows else math.inf
    return {"coef": coef, "n_max": n_max, "grid_max": 2 ** int(math.floor(math.log2(n_max))) if grows else None,
            "used": [ns[i] for i in use], "residual": residual}
