"""Is a checkpoint's Hugging Face export the model the trainer trained? Log-probs of both on fixed sequences.

Registration (flows/register.py) runs this before a checkpoint becomes a model version. Two independent code paths
read the checkpoint:

- the export: the local HF directory that is logged to MLflow, loaded by transformers (AutoModelForCausalLM, fp32,
  CPU) and run through its standard forward (full logits, log-softmax);
- the trainer: the checkpoint's `model/` in the run store, read by the trainer's own resume reader
  (torch.distributed.checkpoint through `dcp_store.StoreReader`: safetensors headers and byte ranges straight from
  the store, not the exported copy) into the native trainer (`TorchTrainBackend`: one rank, CPU, fp32, no Ray), and
  scored by its packed log-prob forward (`PackedLM`: packed attention, chunked LM head), the code that computes the
  training loss.

The trainer is built on the export's config.json (the architecture) and then every weight is replaced by the
store's: DCP's load is strict, so a tensor missing from the store is an error, never the export's value kept.
Compared: at every position of every sequence, the log-prob of the sequence's own next token and the top-k
log-probs of the next-token distribution; the largest absolute difference must be at most TOLERANCE (fp32 on both
sides: the two forwards differ by float summation order only, ~1e-6 on the tiny demo model).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from rlflow.engines.core.config import AlgorithmConfig, TrainConfig
from rlflow.engines.models.hf import encode_prompt, load_model, load_tokenizer
from rlflow.engines.store.run_store import RunStore
from rlflow.engines.train import fsdp
from rlflow.engines.train.dcp_store import StoreReader
from rlflow.engines.train.torch_backend import TorchTrainBackend

TOLERANCE = 1e-4  # largest |log-prob difference| allowed, absolute, fp32 on both sides
CHECK_PROMPTS = 4  # the first eval prompts in the check
TOP_K = 8  # the likeliest next tokens whose log-probs are compared at every position
FIXED_TEXT = "The quick brown fox jumps over the lazy dog. 0123456789 S4821="
SPREAD_IDS = 24  # a sequence of ids spread over the vocabulary: rows of the embedding no prompt may reach


class ExportMismatch(ValueError):
    """The export does not give the trainer's log-probs: the message names the checkpoint and the difference."""


@dataclass(frozen=True)
class ExportCheck:
    """The outcome of one comparison: the largest difference, over how many positions and sequences."""

    max_abs_diff: float
    positions: int
    sequences: int
    tolerance: float = TOLERANCE

    @property
    def passed(self) -> bool:
        return self.max_abs_diff <= self.tolerance

    def summary(self) -> str:
        """One line for tags and logs: what was compared, the largest difference and the bar."""
        verdict = "passed" if self.passed else "failed"
        return (f"{verdict}: max |log-prob difference| {self.max_abs_diff:.3g} (tolerance {self.tolerance:g}, fp32, "
                f"CPU) over {self.positions} positions of {self.sequences} sequences, own token and top-{TOP_K}")


def check_sequences(model_dir: str | Path, tok, prompts: Sequence[str | list[dict]], chat_template: bool
                    ) -> list[list[int]]:
    """Token ids of the sequences both models score: `prompts` rendered as the evaluation renders them
    (models.hf.encode_prompt), a fixed text, and ids spread over the whole vocabulary; each cut to the model's
    context."""
    config = load_model_config(model_dir)
    vocab = int(config.get("vocab_size") or len(tok))
    context = int(config.get("max_position_embeddings") or 64)
    seqs = [encode_prompt(tok, p, chat_template) for p in list(prompts)[:CHECK_PROMPTS]]
    seqs.append(tok(FIXED_TEXT)["input_ids"])
    seqs.append([(7 + 7919 * i) % vocab for i in range(SPREAD_IDS)])
    return [s[:context] for s in seqs if len(s) >= 2]


def load_model_config(model_dir: str | Path) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


def padded(sequences: list[list[int]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded input_ids and attention_mask [N, L], the layout of a TrainBatch."""
    width = max(map(len, sequences))
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    return {"input_ids": ids, "attention_mask": mask}


@torch.no_grad()
def hf_logprobs(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' standard forward: (log-prob of each token [N, L], top-k log-probs of the distribution that
    predicts it [N, L, k]), column t about token t as the trainer aligns them (column 0: 0)."""
    ids = batch["input_ids"]
    logp = torch.log_softmax(model(input_ids=ids, attention_mask=batch["attention_mask"]).logits.float(), dim=-1)
    own = torch.zeros(ids.shape, dtype=torch.float32)
    own[:, 1:] = logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    top = torch.zeros((*ids.shape, TOP_K), dtype=torch.float32)
    top[:, 1:] = logp[:, :-1].topk(min(TOP_K, logp.shape[-1]), dim=-1).values
    return own, top


def export_logprobs(model_dir: str | Path, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The exported directory through transformers, fp32 on the CPU."""
    model = load_model(model_dir, dtype=torch.float32, device="cpu").eval()
    return hf_logprobs(model, batch)


def trainer_logprobs(model_dir: str | Path, checkpoint: RunStore, batch: dict[str, torch.Tensor]
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The checkpoint's weights as the trainer reads them from the store, scored by the trainer's forward.
    `checkpoint`: a store whose run folder is the checkpoint (RunStore.at). One rank, in this process: a default
    process group made here is taken down again."""
    owned = not dist.is_initialized()
    try:
        backend = TorchTrainBackend(str(model_dir), TrainConfig(device="cpu", precision="fp32",
                                                                threads=torch.get_num_threads()), AlgorithmConfig())
        state = get_model_state_dict(backend.model)
        dcp.load(fsdp.unaliased(state), storage_reader=StoreReader(checkpoint, "model"))  # strict: every weight
        set_model_state_dict(backend.model, state)
        return backend.forward_logprobs(batch), backend.forward_topk(batch, TOP_K)[1]
    finally:
        if owned and dist.is_initialized():
            dist.destroy_process_group()


def max_difference(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor],
                   mask: torch.Tensor) -> float:
    """Largest |a - b| over the scored positions (every token after the first of each sequence)."""
    scored = mask.clone()
    scored[:, 0] = 0
    keep = scored.bool()
    own = (a[0] - b[0]).abs()[keep]
    top = (a[1] - b[1]).abs()[keep]
    return float(torch.cat([own.flatten(), top.flatten()]).max()) if keep.any() else 0.0


def compare(reference: tuple[torch.Tensor, torch.Tensor], other: tuple[torch.Tensor, torch.Tensor],
            batch: dict[str, torch.Tensor], what: str, tolerance: float = TOLERANCE) -> ExportCheck:
    """`other` against `reference`; ExportMismatch naming `what` if they differ by more than `tolerance`."""
    mask = batch["attention_mask"]
    check = ExportCheck(max_difference(reference, other, mask), int(mask[:, 1:].sum()), int(mask.shape[0]), tolerance)
    if not check.passed:
        raise ExportMismatch(f"{what}: {check.summary()}")
    return check


def verify_export(export_dir: str | Path, checkpoint: RunStore, prompts: Sequence[str | list[dict]] = (),
                  chat_template: bool = False, tolerance: float = TOLERANCE) -> tuple[ExportCheck, dict]:
    """Compare the export in `export_dir` with the checkpoint in the store as the trainer reads it. Returns the
    check and the batch and export log-probs (to compare further copies, e.g. the model MLflow loads back, with);
    raises ExportMismatch naming the checkpoint and the largest difference."""
    tok = load_tokenizer(export_dir)
    batch = padded(check_sequences(export_dir, tok, prompts, chat_template), tok.pad_token_id or 0)
    exported = export_logprobs(export_dir, batch)
    trained = trainer_logprobs(export_dir, checkpoint, batch)
    what = f"the Hugging Face export of {checkpoint.uri()} does not match the trainer's checkpoint"
    return compare(trained, exported, batch, what, tolerance), {"batch": batch, "logprobs": exported}
