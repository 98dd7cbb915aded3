"""The recipe's embedded-engine settings (rollout.kv_cache, rollout.compile) reach the rollout workers."""

from __future__ import annotations

from conftest import small_recipe

from rlflow.engines.core.config import RLConfig
from rlflow.engines.session.workers import rollout_kwargs


def test_rollout_workers_get_the_kv_cache_and_compile_settings(tmp_path) -> None:
    cfg = RLConfig.model_validate(small_recipe(tmp_path, rollout={
        "prompts_per_step": 8, "samples_per_prompt": 4, "max_new_tokens": 4, "compile": True,
        "kv_cache": {"page_size": 8, "tokens": 4096, "share_prompts": False}}))
    kwargs = rollout_kwargs(cfg, "model")(0)
    assert kwargs["compile"] is True
    assert kwargs["kv_cache"] == cfg.rollout.kv_cache
    kv = kwargs["kv_cache"]
    assert (kv.page_size, kv.tokens, kv.share_prompts) == (8, 4096, False)
