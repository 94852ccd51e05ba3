"""Symbolic proof of DESIGN.md's factorized (UT) identity for every parent array of up to 4 nodes.

Sympy builds both sides from symbols (K = V = 2): the sequential recurrence along parents, and the
tree-masked UT form O = scale (e^gamma Q) S0 + Attn u with u = T (beta V) - T (beta e^gamma K) S0,
T = (I + A)^-1, plus every node's state S_a = e^gamma_a S0 + sum_{m on path(a)} e^(gamma_a - gamma_m) k_m u_m^T.
The decays are products of per-node alphas (alpha = e^g), so both sides are polynomials and
their difference must expand to exactly zero (the inverse of a unit lower-triangular matrix is polynomial).
"""

import itertools

import pytest
import sympy as sp
import torch

from specla_compile.runtime.topology import ancestor_mask, validate_parents

DK, DV = 2, 2


def all_parent_arrays(max_nodes: int):
    for n in range(1, max_nodes + 1):
        for tail in itertools.product(*[range(-1, j) for j in range(1, n)]):
            yield (-1, *tail)


def symbols_for(n: int):
    vec = lambda name, j, d: sp.Matrix([sp.Symbol(f"{name}{j}_{i}") for i in range(d)])  # noqa: E731
    q = [vec("q", j, DK) for j in range(n)]
    k = [vec("k", j, DK) for j in range(n)]
    v = [vec("v", j, DV) for j in range(n)]
    alpha = [sp.Symbol(f"a{j}", positive=True) for j in range(n)]
    beta = [sp.Symbol(f"b{j}") for j in range(n)]
    s0 = sp.Matrix(DK, DV, lambda i, c: sp.Symbol(f"s{i}_{c}"))
    return q, k, v, alpha, beta, s0, sp.Symbol("scale")


@pytest.mark.parametrize("parents", list(all_parent_arrays(4)), ids=str)
def test_factorized_identity(parents):
    n = len(parents)
    q, k, v, alpha, beta, s0, scale = symbols_for(n)
    torch_parents = validate_parents(torch.tensor([parents]))
    strict = ancestor_mask(torch_parents)[0].tolist()
    inclusive = ancestor_mask(torch_parents, inclusive=True)[0].tolist()

    # sequential recurrence along parents
    states, outputs = [], []
    for j, p in enumerate(parents):
        prev = s0 if p < 0 else states[p]
        s = alpha[j] * (sp.eye(DK) - beta[j] * k[j] * k[j].T) * prev + beta[j] * k[j] * v[j].T
        states.append(s)
        outputs.append(scale * s.T * q[j])

    # e^gamma_j = product of alphas on the root..j path; e^(gamma_j - gamma_m) for m an ancestor of j
    exp_gamma = [sp.Mul(*[alpha[m] for m in range(n) if inclusive[j][m]]) for j in range(n)]
    decay = lambda j, m: exp_gamma[j] / exp_gamma[m]  # noqa: E731
    a = sp.Matrix(n, n, lambda j, m: beta[j] * decay(j, m) * (k[j].T * k[m])[0] if strict[j][m] else 0)
    t = (sp.eye(n) + a).inv()
    kmat = sp.Matrix.vstack(*[(beta[j] * exp_gamma[j] * k[j]).T for j in range(n)])
    vmat = sp.Matrix.vstack(*[(beta[j] * v[j]).T for j in range(n)])
    u = t * vmat - t * kmat * s0
    attn = sp.Matrix(n, n, lambda j, m: scale * decay(j, m) * (q[j].T * k[m])[0] if inclusive[j][m] else 0)
    qmat = sp.Matrix.vstack(*[(exp_gamma[j] * q[j]).T for j in range(n)])
    o = scale * qmat * s0 + attn * u

    for j in range(n):
        assert (o[j, :].T - outputs[j]).expand() == sp.zeros(DV, 1)
        s_fact = exp_gamma[j] * s0 + sum(
            (decay(j, m) * k[m] * u[m, :] for m in range(n) if inclusive[j][m]), sp.zeros(DK, DV)
        )
        assert (s_fact - states[j]).expand() == sp.zeros(DK, DV)
