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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["SamplingConfig", "greedy_accept", "sample_accept", "process_logits"]


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
    j = torch.arange(k, device=logits.device)[None, :]
    match = (draft_tokens[:, :k] == pred[:, :k]) & (j < num_drafts[:, None])
    n = match.long().cumprod(dim=1).sum(dim=1)
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
    rows = torch.arange(B, device=dev)
    if k > 0:
        d = draft_tokens[:, :k]
        p_d = p[:, :k].gather(2, d[..., None])[..., 0]  # [B, k]
        if draft_probs is None:
            q_d = torch.ones_like(p_d)
        else:
            q_d = draft_probs[:, :k].float().gather(2, d[..., None])[..., 0]
        u = torch.rand(B, k, device=dev, generator=generator)
        ok = u * q_d < p_d  # accept with probability min(1, p/q)
        ok &= torch.arange(k, device=dev)[None, :] < num_drafts[:, None]
        n = ok.long().cumprod(dim=1).sum(dim=1)
    else:
        n = torch.zeros(B, dtype=torch.long, device=dev)
    target = p[rows, n]  # [B, V]
    rejected = n < num_drafts
    if k > 0:  # computed for every row and selected on the device: no host sync
        d_rej = draft_tokens.gather(1, n.clamp(max=max(draft_tokens.shape[1] - 1, 0))[:, None])[:, 0]
        if draft_probs is None:
            q = torch.zeros_like(target)
            q[rows, d_rej] = 1.0
        else:
            q = draft_probs[rows, n.clamp(max=draft_probs.shape[1] - 1)].float()
        resid = (target - q).clamp(min=0)
        mass = resid.sum(-1, keepdim=True)
        # if the residual vanishes (p == q up to rounding), fall back to p: the rejection had
        # probability ~0 and p is the exact conditional then
        resid = torch.where(mass > 0, resid / mass.clamp(min=1e-30), target)
        target = torch.where(rejected[:, None], resid, target)
    next_token = torch.multinomial(target, 1, generator=generator)[:, 0]
    return n, next_token
