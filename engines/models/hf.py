"""Models and tokenizers in Hugging Face format.

Every backend loads a model from a local HF directory, so a tiny demo model and a real checkpoint take
the same path. The demo's model is built from the recipe (no hub access) with a character tokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, processors
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForTokenClassification,
    AutoTokenizer,
    LlamaConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)
from transformers.utils import logging as hf_logging

from rlflow.engines.core.config import ModelConfig
from rlflow.engines.models.grouped_experts import use_grouped_experts
from rlflow.engines.models.routing import use_routing_replay
from rlflow.engines.models.vision_language import build_tiny_vl_model, is_vision_language

hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARS = "0123456789+=SR"

# the demo's chat template: BOS, then the messages' contents back to back (the vocabulary has no role words)
CHAT_TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# rollout.precision: fp8 computes, and receives weight syncs, in bf16 (its projections are stored in e4m3)
ROLLOUT_DTYPES = {**DTYPES, "fp8": torch.bfloat16}


def build_char_tokenizer(chars: str = CHARS) -> PreTrainedTokenizerFast:
    """A character-level tokenizer: one token per char, BOS prepended, as HF tokenizers behave."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + list(chars))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(cfg: ModelConfig, out_dir: str | Path, seed: int) -> Path:
    """Create a randomly initialised Llama/Qwen2 (or tiny Qwen2-VL) model and the char tokenizer in `out_dir`."""
    out_dir = Path(out_dir)
    tokenizer = build_char_tokenizer(CHARS + "".join(c for c in dict.fromkeys(cfg.extra_chars) if c not in CHARS))
    if cfg.arch == "qwen2_vl":
        return build_tiny_vl_model(cfg, out_dir, seed, tokenizer)
    config_cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[cfg.arch]
    hf_config = config_cls(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_seq_len,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.nn.Module:
    """Load a causal LM (or a vision-language model: Qwen2-VL, Qwen2.5-VL) from a local HF directory. SDPA attention
    is used where transformers offers it, and MoE experts run as grouped matmuls (engines/models/grouped_experts.py),
    the same in the trainer and the engine, behind routers that can record and replay their choice
    (engines/models/routing.py)."""
    auto = AutoModelForImageTextToText if is_vision_language(path) else AutoModelForCausalLM
    model = auto.from_pretrained(str(path), dtype=dtype, attn_implementation="sdpa")
    use_grouped_experts(model)
    use_routing_replay(model)
    return model.to(device)


def load_value_model(path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.nn.Module:
    """A critic: the causal LM's body with a scalar head on every position (HF's *ForTokenClassification, 1 label).

    Loaded from a causal-LM directory, the body takes its weights and the LM head is dropped; the new value head is
    set to zero, so every value starts at exactly 0 and the first advantages are the plain (whitened) returns
    rather than the noise of a random head. Loaded from a critic's own checkpoint, the head is kept. No dropout on
    the head: value targets are noisy enough. save_pretrained writes a model transformers loads as it is.
    """
    config = AutoConfig.from_pretrained(str(path), num_labels=1)
    config.classifier_dropout = 0.0
    from_critic = any(a.endswith("ForTokenClassification") for a in config.architectures or [])
    model = AutoModelForTokenClassification.from_pretrained(
        str(path), config=config, dtype=dtype, attn_implementation="sdpa"
    )
    if not from_critic:
        with torch.no_grad():
            model.score.weight.zero_()
            if model.score.bias is not None:
                model.score.bias.zero_()
    return model.to(device)


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    tok = AutoTokenizer.from_pretrained(str(path))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def model_context(cfg: ModelConfig) -> tuple[int, str]:
    """Tokens one sequence of the model holds (prompt + response) and the setting it comes from, for messages:
    max_position_embeddings of model.path's config.json, or model.max_seq_len of a model the recipe builds."""
    if not cfg.path:
        return cfg.max_seq_len, "model.max_seq_len"
    config = Path(cfg.path) / "config.json"
    top = json.loads(config.read_text())
    # a vision-language model's context is its language model's (text_config)
    positions = top.get("max_position_embeddings", (top.get("text_config") or {}).get("max_position_embeddings"))
    if not isinstance(positions, int):
        raise ValueError(f"model.path: {config} has no max_position_embeddings (the model's context)")
    return positions, f"max_position_embeddings in {config}"


def rollout_context(cfg: ModelConfig, rollout_backend: str) -> tuple[int, str]:
    """Tokens one rollout sequence holds (prompt + response) and where the number comes from: the model's context.
    Both engines take it (the embedded one pages its KV cache, so no constant caps it; an SGLang server does the
    same unless its args set --context-length); `rollout_backend` is kept for callers that name it."""
    del rollout_backend
    return model_context(cfg)


def prompt_input(row: dict) -> str | list[dict]:
    """What a data row gives the model: its chat messages (verl and TRL conversational rows), else its text."""
    return row.get("messages") or row["prompt"]


def encode_prompt(tokenizer, prompt: str | list[dict], chat_template: bool = False) -> list[int]:
    """Token ids of a prompt. With chat_template the prompt is one user message in the tokenizer's chat template,
    ending with the generation prompt; the template writes its own special tokens, so none are added twice.
    A prompt given as chat messages always goes through the chat template, whatever chat_template says."""
    if isinstance(prompt, str) and not chat_template:
        return tokenizer(prompt)["input_ids"]
    if not tokenizer.chat_template:
        what = "data.chat_template" if isinstance(prompt, str) else "a prompt given as chat messages"
        raise ValueError(f"{what}: the tokenizer of {tokenizer.name_or_path} has no chat template")
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def decode_responses(tokenizer, responses: Sequence[Sequence[int]], stopped: Sequence[bool]) -> list[str]:
    """The text of each response as the reward judges it: what a user of the model gets. Special tokens stay
    visible, so a `<unk>` or `<bos>` where the answer should end is no answer (stripped, it scored as the answer
    while the model never learned to stop); only the stop token that ended a finished response is left out."""
    special = set(tokenizer.all_special_ids)
    trimmed = [list(ids[:-1]) if done and len(ids) and int(ids[-1]) in special else list(ids)
               for ids, done in zip(responses, stopped, strict=True)]
    return tokenizer.batch_decode(trimmed, skip_special_tokens=False)


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
