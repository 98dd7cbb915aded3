"""rollout.env: an environment, named by import path, that the built-in env rollout drives episode by episode
(engines/env/, docs/agents.md)."""

from __future__ import annotations

import re
from typing import Any

from pydantic import Field, field_validator

from rlflow.engines.core.config.base import Section

ENV_ROLLOUT_FN = "rlflow.engines.rollout.env_rollout:env_rollout"
_IMPORT_PATH = r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*"


class EnvConfig(Section):
    """Where the episodes of a multi-turn rollout come from: `cls` is instantiated once per episode inside env host
    actors, `reset(sample)` gives the first observation and `step(action)` the next one with a reward."""

    cls: str = Field(..., description="Import path of the environment class, 'package.module:Class' (docs/agents.md: "
                     "reset(sample) -> observation; step(action) -> (observation, reward, done, info)).")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the class (plain data: "
                                   "they travel to the env host actors). A `sandbox` parameter of the class is "
                                   "given the host's SandboxPool (config section `sandbox`) instead.")
    actors: int = Field(1, gt=0, description="Env host actors; each holds up to episodes_per_actor live episodes.")
    episodes_per_actor: int = Field(64, gt=0, description="Episodes an env host runs at once; more wait for a slot.")
    max_turns: int = Field(4, gt=0, description="Model turns per episode; an episode not done by then ends "
                           "truncated (finish_reason length) with the rewards it has.")
    step_timeout_s: float = Field(60.0, gt=0, description="Seconds a reset or step may take; past it the step "
                                  "fails with an error naming the environment and the episode.")
    use_ray: bool | None = Field(None, description="Env hosts as Ray actors (true) or objects in the driver's rollout "
                                 "loop (false); empty: cluster.use_ray.")

    @field_validator("cls")
    @classmethod
    def _import_path(cls, value: str) -> str:
        if not re.fullmatch(_IMPORT_PATH, value):
            raise ValueError(f"{value!r} is not an import path of the form 'package.module:Class'")
        return value
