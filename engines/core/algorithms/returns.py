"""Token-level credit [B, T]: outcome rewards placed on the last token, discounted returns, whitening,
REINFORCE++ and GAE, and how much of the returns a critic explains.

Positions under mask == 0 are not steps: they get 0, add no reward and no discount, and returns pass through them.
"""

from __future__ import annotations

import torch


def outcome_token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token rewards [B, T] from one reward per sequence [B]: the reward sits on the last token under the mask.

    This is what turns an outcome reward into the token rewards that discounted returns and GAE expect. A row with
    an empty mask has nowhere to put its reward and is all 0.
    """
    valid = mask > 0
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    last = mask.shape[-1] - 1 - valid.flip(-1).int().argmax(dim=-1)  # argmax gives the first hit of the flip
    rows = valid.any(dim=-1).nonzero().squeeze(-1)
    out[rows, last[rows]] = rewards.float().to(out.device)[rows]
    return out


def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """G_t = sum over later response tokens s >= t of gamma^(steps from t to s) * r_s, per token [B, T].

    Positions under mask == 0 are not steps: they get 0, add no reward and no discount, and the return passes
    through them, so a tool output masked out in the middle of a multi-turn response does not cut the credit of
    the tokens before it.
    """
    valid = mask > 0
    r = torch.where(valid, token_rewards.float(), 0.0)
    out = torch.zeros_like(r)
    running = torch.zeros_like(r[:, 0])
    for t in reversed(range(r.shape[-1])):
        running = torch.where(valid[:, t], r[:, t] + gamma * running, running)
        out[:, t] = torch.where(valid[:, t], running, 0.0)
    return out


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """(values - mean) / (std + eps) over every token under the mask of the batch; 0 off the mask.

    Unbiased std, as torch.std. If all masked values are equal (or there are fewer than two) the result is
    exactly 0: the batch carries no signal, and a rounding error must not turn into a full-size advantage.
    """
    valid = mask > 0
    x = values.float()
    n = valid.sum()
    picked = x[valid]
    if n < 2 or bool((picked == picked[0]).all()):
        return torch.zeros_like(x)
    mean = picked.mean()
    std = picked.std()
    return torch.where(valid, (x - mean) / (std + eps), 0.0)


def reinforce_pp_advantages(
    token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, eps: float = 1e-6
) -> torch.Tensor:
    """REINFORCE++: discounted returns per token, whitened over all response tokens of the batch [B, T].

    No critic and no group: the batch mean is the baseline and the batch std the scale, which is what makes it
    work with one sample per prompt. With KL in the reward each token's return also carries the KL penalties of
    the tokens after it (see kl_reward_penalty).
    """
    return masked_whiten(discounted_returns(token_rewards, mask, gamma), mask, eps)


def gae_advantages(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation for a critic: (advantages, returns), each [B, T], 0 off the mask.

    delta_t = r_t + gamma * V_next - V_t and A_t = delta_t + gamma * lam * A_next, where "next" is the next token
    under the mask (masked positions are skipped, as in discounted_returns) and V after the last token is 0.
    returns = A + V are the value targets. lam = 1 gives Monte-Carlo returns minus V; lam = 0 the one-step TD error.
    Whiten the advantages (masked_whiten) in the caller if the recipe wants it. Values are constants here.
    """
    valid = mask > 0
    r = torch.where(valid, token_rewards.float(), 0.0)
    v = torch.where(valid, values.detach().float(), 0.0)
    adv = torch.zeros_like(r)
    next_value = torch.zeros_like(r[:, 0])
    next_adv = torch.zeros_like(r[:, 0])
    for t in reversed(range(r.shape[-1])):
        delta = r[:, t] + gamma * next_value - v[:, t]
        a_t = delta + gamma * lam * next_adv
        adv[:, t] = torch.where(valid[:, t], a_t, 0.0)
        next_value = torch.where(valid[:, t], v[:, t], next_value)
        next_adv = torch.where(valid[:, t], a_t, next_adv)
    return adv, torch.where(valid, adv + v, 0.0)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1 - Var(returns - values) / Var(returns) over the tokens under the mask: the share of the returns' variance
    the critic's values explain. 1 is a perfect critic, 0 one no better than the mean return, below 0 worse.
    0 when the returns do not vary (nothing to explain) or fewer than two tokens are masked in."""
    valid = mask > 0
    r, v = returns.float()[valid], values.float()[valid]
    if r.numel() < 2:
        return torch.tensor(0.0)
    var = r.var(unbiased=False)
    if var == 0:
        return torch.tensor(0.0)
    return 1 - (r - v).var(unbiased=False) / var
