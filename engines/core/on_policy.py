"""rollout.true_on_policy's promise, checked every train step: the trainer's log-prob of every sampled token equals
the rollout engine's bit for bit (importance ratio exactly 1), or the step stops with OnPolicyMismatch.

Not a health gate with a threshold: with the mode on, any difference at all means the two sides no longer run the
same computation (a weight sync that delivered other bits, an op outside engines/models/invariant.py), so it fails
at once instead of training on a ratio that only looks close to 1.
"""

from __future__ import annotations

DIFF_MAX, DIFF_TOKENS = "train/rollout_logprob_diff_max", "train/rollout_logprob_diff_tokens"


class OnPolicyMismatch(RuntimeError):
    """The trainer's and the rollout engine's log-probs of one step's tokens differ under rollout.true_on_policy."""

    def __init__(self, step: int, max_diff: float, tokens: int):
        super().__init__(f"rollout.true_on_policy: step {step}: the trainer's log-probs are not the rollout engine's: "
                         f"max |diff| {max_diff:.6g} over {tokens} tokens (expected exactly 0: ratio 1); the two "
                         "sides no longer compute the same (weights, dtype or an op outside engines/models/"
                         "invariant.py)")
        self.step, self.max_diff, self.tokens = step, max_diff, tokens


def check_on_policy(step: int, metrics: dict[str, float]) -> None:
    """Raise OnPolicyMismatch where the step measured a difference (train/rollout_logprob_diff_max) that is not 0;
    a step that measured nothing (no tokens with rollout log-probs) passes."""
    peak = metrics.get(DIFF_MAX)
    if peak is not None and peak != 0.0:  # NaN too: not equal
        raise OnPolicyMismatch(step, peak, int(metrics.get(DIFF_TOKENS, 0)))
