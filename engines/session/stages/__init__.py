"""The work of each stage of an RL step, one module a stage, in the flow's order (tasks/stages.py,
flows/post_train.py):

    rollout (dynamic_sampling) -> reward -> teacher -> advantages -> train -> sync -> checkpoint -> evaluate

Each stage takes the session's engines (`RunEngines`, engines/session/run_engines.py) and the step's state
(`StepState`, engines/session/step_state.py), and returns a small dict of metrics; tensors stay in the state or
in the workers. Shared by several stages: prompting (rows -> the rollout function's prompts, sampling parameters,
seeds), train_batch (the packed batch and forward passes over it), healing (dead workers replaced in-run).
"""

from rlflow.engines.session.stages import (
    advantages,
    checkpoint,
    evaluate,
    reward,
    rollout,
    sync,
    teacher,
    train,
)

__all__ = ["advantages", "checkpoint", "evaluate", "reward", "rollout", "sync", "teacher", "train"]
