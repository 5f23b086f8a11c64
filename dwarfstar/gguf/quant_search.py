"""Vectorised scale searches shared by the K-quant and IQ2 encoders.

They follow the searches of ggml's `ggml-quants.c` (`make_qkx2_quants`/`make_qkx3_quants` and
`make_qp_quants`), rewritten to run over a whole batch of sub-blocks at once: every candidate scale of
a search is evaluated for every sub-block in one tensor operation, and the best one is picked per
sub-block with `argmin`, which keeps ggml's "first candidate that is strictly better wins" order.
Each row of the inputs is one independent sub-block.
"""

from __future__ import annotations

import torch

# ggml's GROUP_MAX_EPS: a sub-block whose largest value is below this quantizes to all zeros.
GROUP_MAX_EPS = 1e-15


def fit_scale_min(
    x: torch.Tensor, w: torch.Tensor, nmax: int, rmin: float, rdelta: float, nstep: int, mad: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Best (scale, min) per row for x ≈ scale·l − min with integer l in [0, nmax], min ≥ 0.

    ggml's search: start from the plain grid over [min(x, 0), max(x)], then try `nstep + 1` grids with
    (rmin + rdelta·k + nmax) levels, each refitted by weighted least squares (offset clamped so that
    min ≥ 0), keeping a refit when it lowers Σ w·err² (Σ w·|err| when `mad`). As in ggml, each grid is
    laid from the best offset found so far, so the steps run in order; the batch runs in parallel.
    x, w: (n_rows, n). Returns (scale, min), each (n_rows,).
    """
    lo = x.amin(-1, keepdim=True).clamp(max=0)
    top = x.amax(-1, keepdim=True)
    flat = top == lo
    span = torch.where(flat, torch.ones_like(top), top - lo)
    wx = w * x
    # the sums in float64: the least-squares determinant cancels badly in float32
    s_w, s_x = w.sum(-1, keepdim=True).double(), wx.sum(-1, keepdim=True).double()
    s_xx = (wx * x).sum(-1, keepdim=True).double()

    def error(scale: torch.Tensor, offset: torch.Tensor, q: torch.Tensor, sums: tuple) -> torch.Tensor:
        if mad:
            return (((q * scale.float() + offset.float()) - x).abs_() * w).sum(-1, keepdim=True).double()
        s_q, s_qq, s_xq = sums  # Σ w (s·q + o − x)², expanded so it needs only these sums
        return (
            scale * scale * s_qq
            + 2 * scale * offset * s_q
            - 2 * scale * s_xq
            + offset * offset * s_w
            - 2 * offset * s_x
            + s_xx
        )

    def levels(iscale: torch.Tensor, offset: torch.Tensor) -> tuple[torch.Tensor, tuple]:
        q = ((x - offset.float()) * iscale).round_().clamp_(0, nmax)
        wq = w * q
        return q, (
            wq.sum(-1, keepdim=True).double(),
            (wq * q).sum(-1, keepdim=True).double(),
            (wq * x).sum(-1, keepdim=True).double(),
        )

    offset = lo.double()
    scale = (span / nmax).double()
    q, sums = levels(nmax / span, offset)
    best = error(scale, offset, q, sums)
    for k in range(nstep + 1):
        # as in ggml, the grid starts at the best offset so far and spans from there to max(x)
        iscale = (rmin + rdelta * k + nmax) / torch.where(flat, torch.ones_like(top), top - offset.float())
        q, (s_q, s_qq, s_xq) = levels(iscale, offset)
        det = s_w * s_qq - s_q * s_q
        ok = det > 0
        det = torch.where(ok, det, torch.ones_like(det))
        new_scale = (s_w * s_xq - s_x * s_q) / det
        new_offset = (s_qq * s_x - s_q * s_xq) / det
        positive = new_offset > 0
        new_offset = torch.where(positive, torch.zeros_like(new_offset), new_offset)
        new_scale = torch.where(positive, s_xq / torch.where(s_qq > 0, s_qq, torch.ones_like(s_qq)), new_scale)
        err = error(new_scale, new_offset, q, (s_q, s_qq, s_xq))
        take = ok & (err < best)
        best = torch.where(take, err, best)
        scale = torch.where(take, new_scale, scale)
        offset = torch.where(take, new_offset, offset)
    scale = torch.where(flat, torch.zeros_like(scale), scale).float().squeeze(-1)
    offset = torch.where(flat, lo.double(), offset).float().squeeze(-1)
    return scale, -offset


def fit_scale(x: torch.Tensor, w: torch.Tensor, nmax: int, sweeps: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """Best scale per row for x ≈ scale·l with integer l in [0, nmax], x ≥ 0 (ggml's make_qp_quants).

    Nine grids around nmax/max(x) are tried, then each l is nudged one at a time (up to `sweeps` passes)
    while that raises (Σ w x l)² / Σ w l², the weighted fit quality; the scale is the least-squares one.
    x, w: (n_rows, n). Returns (scale (n_rows,), l (n_rows, n) as float).
    """
    top = x.amax(-1)
    empty = top < GROUP_MAX_EPS
    top = torch.where(empty, torch.ones_like(top), top)
    steps = [0.0, -0.4, -0.3, -0.2, -0.1, 0.1, 0.2, 0.3, 0.4]  # ggml's order: base grid first
    iscale = (torch.tensor(steps, device=x.device) + nmax) / top[:, None]  # (rows, 9)
    q = (x[:, None, :] * iscale[:, :, None]).round_().clamp_(0, nmax)
    err = ((x[:, None, :] - q / iscale[:, :, None]).square_() * w[:, None, :]).sum(-1)
    best = err.argmin(-1)
    q = q[torch.arange(q.shape[0], device=x.device), best]  # (rows, n)
    wx = w * x
    s_xq = (wx * q).sum(-1)
    s_qq = (w * q * q).sum(-1)
    for _ in range(sweeps):
        changed = torch.zeros((), dtype=torch.bool, device=x.device)
        for i in range(x.shape[1]):
            wi, wxi, qi = w[:, i], wx[:, i], q[:, i]
            xq = s_xq - wxi * qi
            qq = s_qq - wi * qi * qi
            ok = (xq > 0) & (qq > 0)
            new = (x[:, i] * qq / torch.where(ok, xq, torch.ones_like(xq))).round_().clamp_(0, nmax)
            xq = xq + wxi * new
            qq = qq + wi * new * new
            take = ok & (new != qi) & (xq * xq * s_qq > s_xq * s_xq * qq)
            q[:, i] = torch.where(take, new, qi)
            s_xq = torch.where(take, xq, s_xq)
            s_qq = torch.where(take, qq, s_qq)
            changed |= take.any()
        if not changed:
            break
    scale = torch.where(s_qq > 0, s_xq / torch.where(s_qq > 0, s_qq, torch.ones_like(s_qq)), torch.zeros_like(s_qq))
    scale = torch.where(empty, torch.zeros_like(scale), scale)
    q = torch.where(empty[:, None], torch.zeros_like(q), q)
    return scale, q
