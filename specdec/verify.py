"""Acceptance: greedy matching and lossless speculative (rejection) sampling.

Given the target's logits for the T = 1 + k step tokens ``[x_L, d_1..d_k]`` (logit j predicts
the token after step token j), acceptance picks per row the number ``n`` of accepted drafts
and the correction/bonus token ``c`` that follows them.

Greedy: ``n`` = length of the longest prefix of drafts equal to the target's argmax at each
position, ``c`` = argmax after the last accepted draft. The output equals plain greedy
decoding token for token.

Sampling (Leviathan, Kalman & Matias 2023; Chen et al. 2023): with target distribution p and
draft distribution q (after the same temperature / top-k / top-p processing), accept d_j with
probability ``min(1, p(d_j) / q(d_j))``; at the first rejection sample ``c`` from
``norm(max(p - q, 0))``; after k acceptances sample the bonus ``c`` from p. A drafter without
probabilities (n-gram, custom) proposes deterministically, i.e. q is one-hot at d_j. The
output distribution equals sampling from the target alone.

Trees (:mod:`specdec.tree`): :func:`accept_tree` picks each row's deepest accepted node of a
draft tree verified in one forward — greedy (the path whose tokens equal the target's argmax
along it: the output equals plain greedy decoding), lossless sampling (sample the target at
each node and follow the child holding the sample; with deterministic top-k candidates this is
SpecInfer's multi-candidate rejection sampling, Miao et al. 2024), or Medusa's *typical
acceptance* (Cai et al. 2024; ``acceptance="typical"``: a candidate is accepted when its target
probability exceeds ``min(posterior_threshold, posterior_alpha * exp(-H))``; NOT
distribution-preserving).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ACCEPTANCE_MODES", "POSTERIOR_ALPHA", "POSTERIOR_THRESHOLD", "SamplingConfig", "accept_tree",
           "greedy_accept", "process_logits", "sample_accept"]

#: tree acceptance modes: ``"exact"`` (greedy / lossless sampling) or Medusa's ``"typical"``
ACCEPTANCE_MODES = ("exact", "typical")
#: Medusa's typical-acceptance defaults (epsilon and delta of the threshold min(eps, delta * exp(-H)))
POSTERIOR_THRESHOLD = 0.09
POSTERIOR_ALPHA = 0.3


@dataclass
class SamplingConfig:
    """Sampling parameters, applied to target and draft alike (HF's warpers, in HF's order).

    temperature > 0; top_k >= 1 or None/0 (off); 0 < top_p <= 1 or None (off).
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        if not (isinstance(self.temperature, (int, float)) and self.temperature > 0):
            raise ValueError(f"temperature must be a number > 0 when sampling, got {self.temperature!r}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0):
            raise ValueError(f"top_k must be a non-negative int or None, got {self.top_k!r}")
        if self.top_p is not None and not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1] or None, got {self.top_p!r}")

    def warpers(self):
        from transformers.generation.logits_process import (
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        out = []
        if self.temperature != 1.0:
            out.append(TemperatureLogitsWarper(float(self.temperature)))
        if self.top_k:
            out.append(TopKLogitsWarper(top_k=int(self.top_k)))
        if self.top_p is not None and self.top_p < 1.0:
            out.append(TopPLogitsWarper(top_p=float(self.top_p)))
        return out


def process_logits(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p (transformers' warpers), fp32.

    Args: logits ``[..., V]``. Returns ``[..., V]`` fp32 probabilities.
    """
    shape = logits.shape
    scores = logits.reshape(-1, shape[-1]).float()
    for w in sampling.warpers():
        scores = w(None, scores)
    return torch.softmax(scores, dim=-1).reshape(shape)


def greedy_accept(logits: torch.Tensor, draft_tokens: torch.Tensor, num_drafts: torch.Tensor):
    """Greedy acceptance.

    Args:
        logits: ``[B, T, V]`` target logits for the step tokens (T >= 1 + max k).
        draft_tokens: ``[B, K]`` int64 (K >= T - 1; entries past ``num_drafts[b]`` ignored).
        num_drafts: ``[B]`` int64, k_b.

    Returns:
        ``(num_accepted [B] int64, next_token [B] int64)``.
    """
    B, T, _ = logits.shape
    pred = logits.argmax(dim=-1)  # [B, T]
    k = T - 1
    if k == 0:
        return torch.zeros(B, dtype=torch.long, device=logits.device), pred[:, 0]
    # the leading matches, cut at k_b (the count of leading matches among the first k_b drafts)
    n = torch.minimum((draft_tokens[:, :k] == pred[:, :k]).cumprod(dim=1).sum(dim=1), num_drafts)
    return n, pred.gather(1, n[:, None])[:, 0]


def sample_accept(
    logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    num_drafts: torch.Tensor,
    sampling: SamplingConfig,
    draft_probs: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
):
    """Lossless rejection sampling.

    Args:
        logits: ``[B, T, V]`` target logits. draft_tokens ``[B, K]``, num_drafts ``[B]``.
        sampling: the processing applied to the target (the drafter applied the same).
        draft_probs: ``[B, K, V]`` draft distributions the drafts were sampled from, or None
            for deterministic proposals (one-hot q).
        generator: a ``torch.Generator`` on the logits' device, for reproducibility.

    Returns:
        ``(num_accepted [B] int64, next_token [B] int64)``.
    """
    B, T, V = logits.shape
    dev = logits.device
    p = process_logits(logits, sampling)  # [B, T, V]
    k = T - 1
    if k > 0:
        d = draft_tokens[:, :k]
        p_d = p[:, :k].gather(2, d[..., None])[..., 0]  # [B, k]
        u = torch.rand(B, k, device=dev, generator=generator)
        if draft_probs is None:  # q(d_j) = 1
            ok = u < p_d
        else:
            ok = u * draft_probs[:, :k].float().gather(2, d[..., None])[..., 0] < p_d  # accept w.p. min(1, p/q)
        n = torch.minimum(ok.cumprod(dim=1).sum(dim=1), num_drafts)  # leading acceptances among the k_b drafts
    else:
        n = torch.zeros(B, dtype=torch.long, device=dev)
    target = _at(p, n)  # [B, V]
    rejected = n < num_drafts
    if k > 0:  # computed for every row and selected on the device: no host sync
        d_rej = draft_tokens.gather(1, n.clamp(max=max(draft_tokens.shape[1] - 1, 0))[:, None])[:, 0]
        if draft_probs is None:
            q = torch.zeros_like(target).scatter_(1, d_rej[:, None], 1.0)
        else:
            q = _at(draft_probs, n.clamp(max=draft_probs.shape[1] - 1)).float()
        resid = (target - q).clamp(min=0)
        mass = resid.sum(-1, keepdim=True)
        # if the residual vanishes (p == q up to rounding), fall back to p: the rejection had
        # probability ~0 and p is the exact conditional then
        resid = torch.where(mass > 0, resid / mass.clamp(min=1e-30), target)
        target = torch.where(rejected[:, None], resid, target)
    next_token = torch.multinomial(target, 1, generator=generator)[:, 0]
    return n, next_token


def _at(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x[b, idx[b]]`` of ``x [B, T, V]`` and ``idx [B]`` int64: ``[B, V]`` (one gather)."""
    return x.gather(1, idx[:, None, None].expand(-1, 1, x.shape[2]))[:, 0]


def accept_tree(logits: torch.Tensor, tokens: torch.Tensor, spec, limit: torch.Tensor,
                sampling: SamplingConfig | None = None, generator: torch.Generator | None = None,
                acceptance: str = "exact", posterior_threshold: float = POSTERIOR_THRESHOLD,
                posterior_alpha: float = POSTERIOR_ALPHA):
    """Pick the accepted path of each row.

    Args:
        logits: ``[B, N, V]`` target logits of the tree's nodes (logits j predict the token after node j).
        tokens: ``[B, N]`` int64 node tokens (node 0: the pending token).
        spec: the tree (:class:`~specdec.tree.TreeSpec`). limit: ``[B]`` int64, the deepest node a row may accept (budget; 0 = none).
        sampling: None (greedy) or the sampling settings. generator: for reproducible sampling.
        acceptance: ``"exact"`` (greedy, or lossless sampling: sample the target at every node,
            follow the child holding the sampled token) or ``"typical"`` (Medusa's typical
            acceptance; not distribution-preserving).
        posterior_threshold, posterior_alpha: typical acceptance's epsilon and delta: a node is
            accepted when its parent's target probability of its token exceeds
            ``min(posterior_threshold, posterior_alpha * exp(-entropy))``.

    Returns:
        ``(best [B], num_accepted [B], next_token [B])``: the deepest accepted node (ties, possible
        only with typical acceptance: the path of highest target likelihood), its depth, and the
        correction/bonus token drawn at it.
    """
    B, N, V = logits.shape
    dev = logits.device
    tt = spec.tensors(dev)
    depth = tt["depth"]
    rows = torch.arange(B, device=dev)
    score = torch.zeros(B, N, device=dev)  # path log-likelihood (typical acceptance's tie-break)
    ok = torch.zeros(B, N, dtype=torch.bool, device=dev)
    ok[:, 0] = True
    if acceptance == "typical":
        probs = process_logits(logits, sampling) if sampling is not None else torch.softmax(logits.float(), -1)
        entropy = -(probs * torch.log(probs + 1e-5)).sum(-1)
        thr = torch.minimum(torch.full_like(entropy, posterior_threshold), posterior_alpha * torch.exp(-entropy))
        for d, (idx, par) in enumerate(tt["levels"], start=1):
            p_tok = probs[:, par].gather(2, tokens[:, idx, None])[..., 0]  # [B, n]
            ok[:, idx] = ok[:, par] & (p_tok > thr[:, par]) & (limit >= d)[:, None]
            score[:, idx] = score[:, par] + torch.log(p_tok.clamp(min=1e-30))
    else:
        if sampling is None:
            target = logits.argmax(-1)  # [B, N]
        else:
            p = process_logits(logits, sampling)
            target = torch.multinomial(p.reshape(B * N, V), 1, generator=generator).reshape(B, N)
        for d, (idx, par) in enumerate(tt["levels"], start=1):
            ok[:, idx] = ok[:, par] & (tokens[:, idx] == target[:, par]) & (limit >= d)[:, None]
    deepest = torch.where(ok, depth[None, :], torch.full_like(depth[None, :], -1)).max(1).values
    cand = ok & (depth[None, :] == deepest[:, None])
    best = torch.where(cand, score, torch.full_like(score, float("-inf"))).argmax(1)
    n = depth[best]
    if acceptance != "typical":
        return best, n, target[rows, best]
    if sampling is None:
        return best, n, logits[rows, best].argmax(-1)
    # Medusa's typical sampling of the next token: the target's (processed) distribution without
    # the tokens below the threshold (never empty for posterior_alpha <= 1: exp(-H) <= max p)
    p_best = probs[rows, best]
    p_best = p_best.masked_fill(p_best < thr[rows, best][:, None], 0.0)
    return best, n, torch.multinomial(p_best, 1, generator=generator)[:, 0]
