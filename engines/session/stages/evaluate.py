"""The evaluate stage: the held-out prompts generated once each at eval.temperature (greedy by default) through the
recipe's rollout function, rewarded without counting in the training reward's metrics, and scored
(engines/session/evaluation.py); and the rows of the samples tables MLflow shows for a step."""

from __future__ import annotations

from rlflow.engines.core.batch import RolloutBatch
from rlflow.engines.session.evaluation import score
from rlflow.engines.session.run_engines import RunEngines
from rlflow.engines.session.stages.healing import replace_dead_rollout_workers
from rlflow.engines.session.stages.prompting import prompt_samples, sampling, step_seed
from rlflow.engines.session.stages.reward import fill_rewards, response_texts
from rlflow.engines.session.stages.sync import serve_fresh_adapter
from rlflow.engines.session.step_state import StepState


def run(s: RunEngines, step: int) -> tuple[dict[str, float], list[dict]]:
    """Held-out reward with eval.temperature (greedy by default); also returns a few sample rows."""
    rows = s.eval_rows[: s.cfg.eval.max_prompts]
    if not rows:
        return {}, []
    replace_dead_rollout_workers(s)
    serve_fresh_adapter(s)
    s.gpu.for_rollout()
    prompts = prompt_samples(s, rows, 1, 2**62 + step_seed(s, step))  # seeds apart from training's
    groups = s.runner.run(prompts, sampling(s, s.cfg.eval.temperature))
    b = RolloutBatch.from_samples(prompts, [g[:1] for g in groups])
    responses = response_texts(s, b.split("output_ids"), b.text, b.stopped)
    rewards = fill_rewards(s, b.prompt, responses, b.label, b.fn_reward, [r.get("meta", {}) for r in rows],
                           record=False)
    samples = [
        {"step": step, "prompt": r["prompt"], "response": text, "label": str(r["label"]), "reward": w}
        for r, text, w in zip(rows, responses, rewards, strict=True)
    ]
    scored = score(rewards, b.lengths, n=1)
    metrics = {f"eval/{k}": scored[k] for k in ("reward_mean", "accuracy", "response_len_mean")}
    return metrics | s.gpu.take_metrics(), samples


def sample_rows(st: StepState, k: int) -> list[dict]:
    """The first sample of each of the step's first k prompts, for the samples table."""
    b = st.batch
    return [
        {"step": st.step, "prompt": st.rows[g]["prompt"], "response": b.response[i],
         "label": str(st.rows[g]["label"]), "reward": float(b.reward[i])}
        for i, g in ((int(i), int(b.group[i])) for i in b.group_starts()[:k])
    ]
