"""Supervised fine-tuning on the RL engines: SFT steps, and rejection sampling's generate-verify-keep.

`SFTSession` wraps an `RLSession` (tokenizer, train and rollout workers, weight sync, evaluation, checkpoints)
and adds a pool of examples (prompt ids, response ids) walked in seeded batches. The loss is
`algorithms.sft_loss`: the NLL of the response tokens only, the prompt being context. The Prefect stage tasks
call the same method names as on an RLSession (train, sync_weights, evaluate, save, load), so
flows/sft.py and flows/rejection_sampling.py reuse tasks/stages.py and the run store as post_train does.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from rlflow.engines.core.batch import (
    IMAGE_IDS,
    ROLLOUT_SCHEMA,
    RolloutBatch,
    image_ids,
    pack_samples,
    shard_for_workers,
)
from rlflow.engines.core.config import RLConfig, StorageConfig, TrainConfig
from rlflow.engines.core.protocols import TrainBackend
from rlflow.engines.data.prompts import PromptCursor, load_pairs
from rlflow.engines.models.hf import encode_prompt, prompt_input
from rlflow.engines.session.rl import RLSession
from rlflow.engines.session.stages.checkpoint import save_tokenizer, worker_target
from rlflow.engines.session.stages.prompting import encode_with_images, store_image

# rejection sampling's round table (<run>/rounds/<round>/samples.parquet): a scored rollout batch and which
# samples the verifier kept
ROUND_SCHEMA = ROLLOUT_SCHEMA.append(pa.field("accepted", pa.bool_()))


@dataclass(frozen=True)
class Example:
    prompt: str
    prompt_ids: list[int]
    response_ids: list[int]
    images: tuple[str, ...] = ()  # a vision-language prompt's images, by digest in the run store


def sft_train_config(cfg: RLConfig, rejection: bool) -> TrainConfig:
    """The train section for SFT: one optimizer step per SFT step, so the LR schedule spans the SFT steps."""
    lr = cfg.sft.lr if cfg.sft.lr is not None else cfg.train.lr
    return cfg.train.model_copy(update={"steps": cfg.sft.total_steps(rejection), "mini_batches": 1, "epochs": 1,
                                        "lr": lr})


def accept_samples(
    rewards: list[float], stopped: list[bool], output_ids: list[list[int]], group_size: int, threshold: float,
    max_per_prompt: int,
) -> list[bool]:
    """Which samples rejection sampling keeps: reward >= threshold, ended on its own (a truncated answer is not
    a finished one), and among the first max_per_prompt distinct responses of its prompt's group."""
    keep, seen = [], {}
    for i, (r, done, ids) in enumerate(zip(rewards, stopped, output_ids, strict=True)):
        group = seen.setdefault(i // group_size, set())
        ok = r >= threshold and bool(done) and tuple(ids) not in group and len(group) < max_per_prompt
        if ok:
            group.add(tuple(ids))
        keep.append(ok)
    return keep


def round_table(batch: RolloutBatch, accepted: list[bool]) -> pa.Table:
    """A round's scored samples and which ones were kept, as a table of ROUND_SCHEMA."""
    if batch.reward is None:
        raise ValueError("round_table: the batch has no rewards yet (run the reward stage first)")
    table = batch.to_arrow()
    return table.append_column(ROUND_SCHEMA.field("accepted"), pa.array(accepted, type=pa.bool_()))


def read_round(table: pa.Table, samples_per_prompt: int) -> tuple[RolloutBatch, np.ndarray]:
    """A stored round: its scored batch and the accepted mask."""
    return (RolloutBatch.from_arrow(table, samples_per_prompt),
            np.asarray(table.column("accepted").to_numpy(zero_copy_only=False), dtype=bool))


def tokenize_pairs(tokenizer, pairs: list[dict], chat_template: bool, add_eos: bool) -> list[Example]:
    """Prompts tokenized as the rollout engine tokenizes them (models.hf.encode_prompt),
    responses without special tokens, then EOS so the model learns where an answer ends."""
    prompts = [p["prompt"] for p in pairs]
    if chat_template or any("messages" in p for p in pairs):
        prompt_ids = [encode_prompt(tokenizer, prompt_input(p), chat_template) for p in pairs]
    else:
        prompt_ids = tokenizer(prompts)["input_ids"]
    eos = [tokenizer.eos_token_id] if add_eos else []
    responses = tokenizer([p["response"] for p in pairs], add_special_tokens=False)["input_ids"]
    return [Example(p, ids, r + eos) for p, ids, r in zip(prompts, prompt_ids, responses, strict=True)]


class SFTSession:
    def __init__(self, rl: RLSession, rejection: bool = False):
        self.rl, self.cfg = rl, rl.cfg
        self.examples: list[Example] = []
        self.cursor: PromptCursor | None = None
        self._dp_ranks = rl.train_group.call(TrainBackend.data_parallel_rank)
        self._last_batch: tuple[int, list[Example]] | None = None
        self.rounds: dict[int, pa.Table] = {}  # rejection sampling: each round's table (ROUND_SCHEMA)
        if not rejection:
            if not self.cfg.sft.train_path:
                raise ValueError("sft.train_path: `rlflow sft` needs a prompt/response file")
            pairs = load_pairs(self.cfg.sft.train_path, self.cfg.data.prompt_key, self.cfg.sft.response_key,
                               self.cfg.storage.fsspec_options(self.cfg.sft.train_path),
                               self.cfg.data.max_image_pixels)
            self.set_examples(self.tokenize(pairs), self.cfg.data.seed)

    @classmethod
    def create(cls, cfg: RLConfig, model_path: str, rejection: bool = False, use_ray: bool | None = None):
        """Start the engines with the SFT train settings (sft_train_config); the recipe is otherwise unchanged."""
        sft_cfg = cfg.model_copy(update={"train": sft_train_config(cfg, rejection)})
        return cls(RLSession.create(sft_cfg, model_path, use_ray=use_ray), rejection)

    @classmethod
    def factory(cls, rejection: bool):
        """create() with `rejection` bound: what open_run takes to start this kind of session."""
        return functools.partial(cls.create, rejection=rejection)

    # ---- data ----------------------------------------------------------------------------------------
    def tokenize(self, pairs: list[dict]) -> list[Example]:
        text_pairs = [p for p in pairs if "images" not in p]
        # the template decision is the file's (tokenize_pairs'), not only its text rows'
        template = self.cfg.data.chat_template or any("messages" in p for p in pairs)
        examples = tokenize_pairs(self.rl.tokenizer, text_pairs, template, self.cfg.sft.add_eos) if text_pairs else []
        if len(examples) == len(pairs):
            return examples
        if self.rl.vision is None:
            raise ValueError(f"sft.train_path {self.cfg.sft.train_path}: rows with images, and model.path is not a "
                             "vision-language model (Qwen2-VL or Qwen2.5-VL)")
        text = iter(examples)
        return [self._with_images(p) if "images" in p else next(text) for p in pairs]

    def _with_images(self, pair: dict) -> Example:
        """A vision-language demonstration: the prompt as the rollout encodes it (its images placed by the model's
        processor, stored once by digest), the response and EOS as tokenize_pairs makes them."""
        eos = [self.rl.tokenizer.eos_token_id] if self.cfg.sft.add_eos else []
        with self.rl.tokenizer_lock:
            response = self.rl.tokenizer(pair["response"], add_special_tokens=False)["input_ids"]
        return Example(pair["prompt"], encode_with_images(self.rl, pair, pair["images"]), response + eos,
                       tuple(store_image(self.rl, data) for data in pair["images"]))

    def set_examples(self, examples: list[Example], seed: int) -> None:
        if not examples:
            raise ValueError("SFT: no examples to train on")
        self.examples = examples
        self.cursor = PromptCursor(len(examples), self.cfg.sft.batch_size, seed, self.cfg.data.shuffle)

    # ---- stages --------------------------------------------------------------------------------------
    def train(self, step: int) -> dict[str, float]:
        """One SFT optimizer step on the next sft.batch_size examples, split over the data-parallel workers."""
        t0 = time.perf_counter()
        rows = [self.examples[i] for i in self.cursor.next_batch()]
        self._last_batch = (step, rows)
        n = len(rows)
        batch = pack_samples([e.prompt_ids for e in rows], [e.response_ids for e in rows],
                             [[0.0] * len(e.response_ids) for e in rows], torch.zeros(n),
                             self.rl.tokenizer.pad_token_id)
        if any(e.images for e in rows):
            batch[IMAGE_IDS] = image_ids([e.images for e in rows])
        shards = shard_for_workers(batch, max(self._dp_ranks) + 1, 1)
        self.rl.gpu.for_training()  # colocated: the rollout engine releases its memory, the trainer onloads
        results = self.rl.train_group.call_each(TrainBackend.sft_step, [(shards[r],) for r in self._dp_ranks])
        tokens = float(batch["loss_mask"].sum())
        worker_s = results[0].pop("worker_s")
        return {f"train/{k}": v for k, v in results[0].items()} | {
            "train/response_tokens": tokens, "train/tokens_per_s": tokens / (time.perf_counter() - t0),
            "time/train_worker": worker_s} | self.rl.gpu.take_metrics()

    def sync_weights(self, step: int) -> dict[str, float]:
        return self.rl.sync_weights(step)

    def stage_span(self, stage: str, step: int):
        """The stage's span on the run's trace timeline (tasks/stages.py wraps every stage in it)."""
        return self.rl.stage_span(stage, step)

    def evaluate(self, step: int) -> tuple[dict[str, float], list[dict]]:
        return self.rl.evaluate(step)

    def sample_rows(self, step: int, k: int) -> list[dict]:
        """The first k examples of the last SFT batch, as text."""
        if self._last_batch is None:
            return []
        tok = self.rl.tokenizer
        return [{"step": self._last_batch[0], "prompt": e.prompt,
                 "response": tok.decode(e.response_ids, skip_special_tokens=True)} for e in self._last_batch[1][:k]]

    # ---- rejection sampling --------------------------------------------------------------------------
    def generate_round(self, rnd: int) -> tuple[pa.Table, dict[str, float]]:
        """Sample rollout.samples_per_prompt responses for the next rollout.prompts_per_step prompts, score them
        with the recipe's reward, and mark which ones rejection sampling keeps (column "accepted")."""
        metrics = self.rl.rollout(rnd) | self.rl.reward(rnd)
        batch = self.rl.rollout_batch(rnd)
        rs = self.cfg.sft.rejection
        keep = accept_samples(batch.reward.tolist(), batch.stopped.tolist(),
                              [x.tolist() for x in batch.split("output_ids")], batch.group_size(), rs.threshold,
                              rs.max_per_prompt)
        return round_table(batch, keep), metrics

    def restore_round(self, rnd: int, table: pa.Table) -> dict[str, float]:
        """Take a stored round as this round's samples; the prompt cursor moves as a fresh round would."""
        metrics = self.rl.restore_rollout(rnd, table)
        rewards = self.rl.rollout_batch(rnd).reward.tolist()  # a round's table is scored
        return metrics | {"rollout/reward_mean": sum(rewards) / len(rewards)}

    def use_rounds(self, rnd: int) -> dict[str, float]:
        """Train on what rounds <= rnd kept (or only round rnd's, with accumulate: false)."""
        rs = self.cfg.sft.rejection
        chosen = [r for r in sorted(self.rounds) if r <= rnd and (rs.accumulate or r == rnd)]
        examples, seen = [], set()
        for r in chosen:
            batch, accepted = self._round(r)
            kept = batch.select(accepted)
            images = kept.images or [[] for _ in kept.prompt]
            for prompt, p_ids, o_ids, digests in zip(kept.prompt, kept.prompt_ids, kept.split("output_ids"), images,
                                                     strict=True):
                key = (prompt, tuple(digests), tuple(o_ids.tolist()))  # a VL prompt's text is not all of it
                if key not in seen:  # a prompt drawn again in a later round
                    seen.add(key)
                    examples.append(Example(prompt, p_ids, o_ids.tolist(), tuple(digests)))
        batch, accepted = self._round(rnd)
        n = len(batch)
        passed = [r >= rs.threshold and s for r, s in zip(batch.reward.tolist(), batch.stopped.tolist(), strict=True)]
        solved = np.logical_or.reduceat(accepted, batch.group_starts()).tolist()
        if examples:
            self.set_examples(examples, self.cfg.data.seed * 1_000_003 + rnd)  # one order per round
        elif not self.examples:
            raise RuntimeError(f"rejection sampling round {rnd}: the verifier accepted none of {n} samples (reward "
                               f">= sft.rejection.threshold {rs.threshold}); lower the threshold or sample more")
        return {"rs/accept_frac": sum(passed) / n, "rs/kept": float(accepted.sum()),
                "rs/prompts_solved": sum(solved) / len(solved), "rs/pool": float(len(self.examples))}

    def _round(self, rnd: int) -> tuple[RolloutBatch, np.ndarray]:
        return read_round(self.rounds[rnd], self.cfg.rollout.samples_per_prompt)

    # ---- checkpoints ---------------------------------------------------------------------------------
    def save(self, path, step: int, storage: StorageConfig | None = None, background: bool = False) -> dict:
        """Worker state into `path` (with `storage`: that run store's folder, written by the workers); returns the
        controller state: both data cursors (nothing is in flight). `background`: as RLSession.save."""
        self.rl.gpu.resident()
        how = {"background": True} if background else {}
        self.rl.train_group.call(TrainBackend.save, *worker_target(path, "", storage), **how)
        save_tokenizer(self.rl.tokenizer, path, storage, self.rl.vision.image_processor if self.rl.vision else None)
        return {"cursor": self.rl.prompts.cursor.state_dict(), "weight_version": self.rl.weight_version,
                "sft_cursor": self.cursor.state_dict() if self.cursor else None}

    def written_markers(self) -> list[str]:
        return self.rl.written_markers()

    def drain_saves(self) -> None:
        self.rl.drain_saves()

    def save_problem(self) -> str | None:
        return self.rl.save_problem()

    def load(self, path, controller_state: dict, storage: StorageConfig | None = None) -> None:
        self.rl.load(path, controller_state, storage)
        if controller_state.get("sft_cursor") and self.cursor is not None:
            self.cursor.load_state_dict(controller_state["sft_cursor"])

    def shutdown(self) -> None:
        self.rl.shutdown()

