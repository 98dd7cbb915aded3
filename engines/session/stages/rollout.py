"""The rollout stage: samples_per_prompt responses for the step's prompts through the recipe's rollout function
(ReMax adds each prompt's greedy response; dynamic sampling collects groups whose rewards differ), or a batch
replayed from another run's store or restored from this run's. It opens the step's state."""

from __future__ import annotations

import time

import pyarrow as pa

from rlflow.engines.core.batch import RolloutBatch
from rlflow.engines.rollout.functions import Sample
from rlflow.engines.session.run_engines import RunEngines
from rlflow.engines.session.stages import dynamic_sampling
from rlflow.engines.session.stages.healing import replace_dead_rollout_workers
from rlflow.engines.session.stages.prompting import prompt_samples, sampling, step_seed
from rlflow.engines.session.stages.sync import serve_fresh_adapter
from rlflow.engines.session.step_state import StepState


def run(s: RunEngines, step: int) -> dict[str, float]:
    """Generate samples_per_prompt responses for the next prompts_per_step prompts (or replay them)."""
    if s.replay is not None:
        return replay(s, step)
    t0 = time.perf_counter()
    metrics = replace_dead_rollout_workers(s)
    serve_fresh_adapter(s)
    s.gpu.for_rollout()
    if s.cfg.rollout.dynamic_sampling.enabled:
        prompts, groups, metrics = dynamic_sampling.collect(s, step)
        rows = [p.row for p in prompts]
    else:
        rows = s.prompts.take(step)
        prompts = prompt_samples(s, rows, s.cfg.rollout.samples_per_prompt, step_seed(s, step))
        groups = s.runner.run(prompts, sampling(s, s.cfg.rollout.temperature))
        if s.cfg.algorithm.advantage == "remax":
            groups = _with_greedy_baselines(s, rows, groups, step)
    batch = RolloutBatch.from_samples(prompts, groups, s.routing_width)
    if s.cfg.rollout.dynamic_sampling.enabled:  # its prompts do not follow from the cursor: store both
        batch.metadata |= s.prompts.batch_metadata(step)
    open_step(s, StepState(step, rows, batch))
    metrics |= batch.metrics() | s.gpu.take_metrics()
    return metrics | {"rollout/tokens_per_s": metrics["rollout/tokens"] / (time.perf_counter() - t0)}


def _with_greedy_baselines(s: RunEngines, rows: list[dict], groups: list[list[Sample]], step: int
                           ) -> list[list[Sample]]:
    """ReMax: each group with one more sample, the prompt's greedy response (temperature 0, through the same
    rollout function), marked as the baseline and with an all-0 loss mask: it is rewarded like the others
    and never trained on."""
    prompts = prompt_samples(s, rows, 1, 2**61 + step_seed(s, step))  # seeds apart (greedy needs none)
    greedy = s.runner.run(prompts, sampling(s, 0.0))
    for group, extra in zip(groups, greedy, strict=True):
        base = extra[0]
        base.metadata["remax_baseline"] = True
        base.loss_mask = [0] * len(base.response_ids)
        group.append(base)
    return groups


def replay(s: RunEngines, step: int) -> dict[str, float]:
    """Take step's batch from the replayed run's store, exactly as that run generated it."""
    table = s.replay.load_rollout(step)
    if table is None:
        raise FileNotFoundError(
            f"debug.replay_run: run {s.replay.run!r} has no committed rollout batch for step {step} "
            f"({s.replay.uri('steps', step, 'rollout.parquet')}); a run keeps its batches with "
            "checkpoint.keep_rollouts: true (rollout_only runs always do)")
    return restore(s, step, table) | {"rollout/replayed": 1.0}


def restore(s: RunEngines, step: int, table: pa.Table) -> dict[str, float]:
    """Take a persisted batch as this step's rollout; the data cursor moves exactly as a fresh rollout would."""
    group = s.cfg.rollout.samples_per_prompt
    batch = RolloutBatch.from_arrow(table, group)
    if s.cfg.rollout.dynamic_sampling.enabled:
        s.prompts.restore_dynamic(step, batch.metadata)
        rows = [{"prompt": batch.prompt[i], "label": batch.label[i]} for i in batch.group_starts()]
    else:
        rows = s.prompts.take(step)
    expected = [r["prompt"] for r in rows]
    if len(batch.group_starts()) != len(rows) or batch.prompt != [
            expected[g] if g < len(expected) else None for g in batch.group]:
        raise RuntimeError(f"step {step}: the stored rollout batch was made from other prompts (data changed?)")
    open_step(s, StepState(step, rows, batch))
    return batch.metrics()


def open_step(s: RunEngines, st: StepState) -> None:
    """Make `st` the step's state. The step that trains while this one generates is at most
    max(max_staleness, 1) behind (one behind is also kept synchronously, as always); older ones are
    finished and dropped."""
    behind = st.step - max(s.cfg.rollout.max_staleness, 1)
    s.steps.open(st, drop_before=behind)
    s.prompts.forget_before(behind)
