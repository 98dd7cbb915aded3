"""A sequence-classification reward model as a worker: HF AutoModelForSequenceClassification, called once per
batch share. It is a plain class (engines/cluster wraps it in Ray actors of its own placement group, or keeps
it in this process on CPU) so tests and benchmarks can drive it without Ray."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from rlflow.engines.core.protocols import RewardModelBackend


class SequenceClassifierReward(RewardModelBackend):
    """Scores `template` filled in with the sample (or the [user, assistant] conversation in the tokenizer's chat
    template): the logit of class `label` at the last token, `batch_size` texts a forward."""

    def __init__(self, path: str, device: str = "cpu", dtype: torch.dtype = torch.float32, batch_size: int = 16,
                 max_length: int = 2048, template: str = "{prompt}{response}", chat_template: bool = False,
                 label: int = 0, threads: int | None = None, field: str = "reward.sources"):
        if threads:
            torch.set_num_threads(threads)
        if not (Path(path) / "config.json").is_file():
            raise FileNotFoundError(f"{field}.path: no Hugging Face model (config.json) in {path}")
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.tokenizer.truncation_side = "left"  # the score is read at the last token: keep the end
        if chat_template and not self.tokenizer.chat_template:
            raise ValueError(f"{field}.chat_template: the tokenizer in {path} has no chat template")
        self.model = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype).to(device).eval()
        if self.model.config.pad_token_id is None:  # HF finds each row's last token by the pad id
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        if label >= self.model.config.num_labels:
            raise ValueError(f"{field}.label: {label}, but the model in {path} has "
                             f"{self.model.config.num_labels} label(s)")
        self.device, self.batch_size, self.max_length = device, batch_size, max_length
        self.template, self.chat_template, self.label = template, chat_template, label

    def text(self, prompt: str | list[dict], response: str, label: object) -> str:
        """What the model reads for one sample."""
        if self.chat_template:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
            return self.tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": response}],
                                                      tokenize=False)
        return self.template.format(prompt=prompt, response=response, label=label)

    @torch.no_grad()
    def score(self, prompts: list, responses: list[str], labels: list) -> list[float]:
        texts = [self.text(p, r, lab) for p, r, lab in zip(prompts, responses, labels, strict=True)]
        out: list[float] = []
        for i in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(texts[i:i + self.batch_size], padding=True, truncation=True,
                                 max_length=self.max_length, return_tensors="pt",
                                 add_special_tokens=not self.chat_template)  # a chat template writes its own
            logits = self.model(**{k: v.to(self.device) for k, v in enc.items()}).logits
            out.extend(logits[:, self.label].float().cpu().tolist())
        return out

    def pid(self) -> int:
        return os.getpid()
