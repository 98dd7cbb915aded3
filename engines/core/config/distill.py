"""distill: on-policy distillation from a frozen teacher."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from rlflow.engines.core.config.base import Section, nodes_field


class DistillConfig(Section):
    """On-policy distillation (docs/distillation.md): a frozen teacher scores the student's own samples token by
    token, and the reverse KL(student || teacher) on them joins the loss (or replaces the RL loss)."""

    teacher_path: str | None = Field(
        None, description="HF causal-LM directory of the teacher; empty: no distillation. Any size and architecture "
        "our loaders take, larger than the student or not, with the student's tokenizer (the same vocabulary: "
        "checked at the start).",
    )
    loss: Literal["reverse_kl", "forward_kl", "jsd"] = Field(
        "reverse_kl", description="reverse_kl: KL(student || teacher) estimated on the student's sampled tokens "
        "from the teacher's per-token logprobs (verl's k1/k3 estimator modes, Thinking Machines' on-policy "
        "distillation). forward_kl: KL(teacher || student) over the teacher's top_k tokens at each position "
        "(verl's forward_kl_topk); jsd: GKD's generalised Jensen-Shannon divergence (beta) on the same top_k "
        "(train.backend torch).",
    )
    top_k: int = Field(32, gt=0, description="forward_kl / jsd: the teacher's likeliest tokens per position the "
                       "divergence is taken over.")
    beta: float = Field(0.5, gt=0.0, lt=1.0, description="jsd: the teacher's weight in the mixture m = beta q + "
                        "(1 - beta) p.")
    estimator: Literal["k1", "k2", "k3", "low_var_kl"] = Field(
        "k1", description="Per-token KL estimator (as algorithm.kl_estimator). With policy_gradient its negation, "
        "taken at the sampling policy, is the token's advantage (k1: log q - log p, the reverse-KL gradient); "
        "without, it is backpropagated directly (k2: the reverse-KL gradient; k3: the forward KL's in expectation).",
    )
    policy_gradient: bool = Field(
        True, description="Use the negated per-token estimate as an advantage in the PPO-clip loss (verl's "
        "use_policy_gradient); false: backpropagate the estimator as a loss (GKD-style).",
    )
    coef: float = Field(1.0, gt=0.0, description="Weight of the distillation loss.")
    mode: Literal["added", "alone"] = Field(
        "added", description="added: the distillation loss is added to the RL loss; alone: the RL policy loss "
        "is dropped, the student learns from the teacher only (rewards are still scored and logged).",
    )
    num_workers: int = Field(1, gt=0, description="Teacher workers: data-parallel copies, each scoring its slice.")
    nodes: int = nodes_field("teacher's workers")
    precision: Literal["fp32", "bf16"] | None = Field(
        None, description="The teacher's weights and compute dtype; empty: train.precision.",
    )
    gpus_per_worker: float = Field(
        1.0, gt=0.0, description="GPUs each teacher worker reserves on cuda (a fraction packs a small teacher "
        "beside others).",
    )

    @property
    def enabled(self) -> bool:
        return bool(self.teacher_path)

    def loss_kwargs(self) -> dict[str, Any]:
        """rl_loss's distillation arguments, so every train backend passes the same ones ({} when off)."""
        if not self.enabled:
            return {}
        return {"distill_coef": self.coef, "distill_estimator": self.estimator,
                "distill_policy_gradient": self.policy_gradient, "distill_alone": self.mode == "alone",
                "distill_loss_name": self.loss, "distill_beta": self.beta}

    @property
    def uses_top_k(self) -> bool:
        """The loss needs the teacher's top-k log-probs and ids (forward_kl, jsd), not its sampled-token ones."""
        return self.loss in ("forward_kl", "jsd")
