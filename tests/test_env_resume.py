"""Kill a run in the middle of a multi-turn env rollout (episodes half done, tool calls in flight), resume it, and get
exactly the episodes of a run that was never interrupted: the killed step's rollout is redone from the same data
cursor and seeds, none is duplicated or dropped. Through the CLI, with the python tool environment and the sandbox."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pyarrow as pa
import pytest
import yaml

from rlflow.engines.core.config import StorageConfig
from rlflow.engines.env.python_tool import PythonToolEnv
from rlflow.engines.store.run_store import RunStore
from tests.conftest import small_recipe
from tests.test_resume import _rlflow, prefect_api  # noqa: F401 - prefect_api is a fixture used below

pytestmark = pytest.mark.slow  # ~2.5 min on 2 cores (three flow runs); the env loop's mechanics: tests/test_env.py

STEPS = 4
EPISODES = 8 * 4  # a step's: prompts_per_step x samples_per_prompt (no evaluation runs)
KILL_AFTER = EPISODES + 8  # episodes started before the kill: step 1's rollout has started 8 of its own


class KillOnceEnv(PythonToolEnv):
    """The python tool env that SIGKILLs its own process (the flow's: env hosts run in it, rollout.env.use_ray false)
    at the first step once KILL_AFTER episodes have started, once per marker file: a run killed mid-episode in step
    1's rollout, between a model turn and the tool's answer."""

    started = 0

    def __init__(self, sandbox, marker: str, **kwargs):
        super().__init__(sandbox, **kwargs)
        self.marker = Path(marker)

    def reset(self, sample: dict) -> None:
        KillOnceEnv.started += 1
        return super().reset(sample)

    def step(self, action: dict):
        if KillOnceEnv.started >= KILL_AFTER and not self.marker.exists():
            self.marker.write_text("killed")
            os.kill(os.getpid(), signal.SIGKILL)
        return super().step(action)


def _recipe(tmp_path: Path, name: str, marker: Path) -> Path:
    raw = small_recipe(
        tmp_path, name=name, model={"max_seq_len": 32, "extra_chars": "*"},
        data={"train_path": str(tmp_path.parent / "mul/train.jsonl"),
              "eval_path": str(tmp_path.parent / "mul/eval.jsonl"),
              "generate": {"task": "mul", "num_digits": 2, "num_train": 500, "num_eval": 16}},
        rollout={"env": {"cls": "tests.test_env_resume:KillOnceEnv", "max_turns": 3, "use_ray": False,
                         "kwargs": {"marker": str(marker)}},
                 "prompts_per_step": 8, "samples_per_prompt": 4, "max_new_tokens": 7, "stop": ["="]},
        train={"steps": STEPS, "threads": 1, "mini_batches": 2},
        checkpoint={"every": 2, "keep_rollouts": True}, eval={"every": 0},
        cluster={"use_ray": False})
    raw["storage"] = {"uri": str(tmp_path / "store")}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _episodes(tmp_path: Path, name: str) -> list[dict]:
    """Each step's persisted batch: its prompts and every episode's tokens, mask and reward."""
    store = RunStore(StorageConfig(uri=str(tmp_path / "store")), name)
    assert store.read_json("status.json")["status"] == "finished"
    steps = []
    for step in range(STEPS):
        table: pa.Table = store.load_rollout(step)
        steps.append({k: table.column(k).to_pylist() for k in ("prompt", "group", "prompt_ids", "output_ids",
                                                                "loss_mask", "fn_reward")})
    return steps


def test_a_run_killed_mid_episode_resumes_without_duplicating_or_dropping_one(tmp_path, prefect_api):  # noqa: F811
    reference_dir, killed_dir = tmp_path / "reference", tmp_path / "killed"
    reference_dir.mkdir()
    killed_dir.mkdir()
    never = reference_dir / "never-kill"
    never.write_text("the reference run is not killed")
    done = _rlflow(["run", str(_recipe(reference_dir, "ref", never))], prefect_api)
    assert done.returncode == 0, done.stderr[-3000:]
    marker = killed_dir / "killed"
    recipe = _recipe(killed_dir, "kill", marker)
    killed = _rlflow(["run", str(recipe)], prefect_api)
    assert killed.returncode != 0 and marker.exists(), "the env did not kill the run mid-episode"
    store = RunStore(StorageConfig(uri=str(killed_dir / "store")), "kill")
    assert store.load_rollout(0) is not None and store.load_rollout(1) is None, "killed in step 1's rollout"
    resumed = _rlflow(["run", str(recipe)], prefect_api)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    reference, outcome = _episodes(reference_dir, "ref"), _episodes(killed_dir, "kill")
    for step, (ref, got) in enumerate(zip(reference, outcome, strict=True)):
        assert len(got["prompt"]) == EPISODES, f"step {step}: {len(got['prompt'])} episodes"
        assert got == ref, f"step {step}: the resumed run's episodes differ from the uninterrupted run's"
    assert any(0 in m for s in outcome for m in s["loss_mask"]), "no tool observation in any episode"
