"""Padding-free training forward: a micro-batch's samples as one token stream, log-probs without full logits.

Why: an RL batch mixes responses of a few tokens with responses of thousands. Right-padded to the longest,
a micro-batch spends most of its attention and MLP work on padding, and the LM head materialises
[rows, width, vocab] fp32 logits (4 x 2048 x 151,936 x 4 bytes = 5 GB). Here every micro-batch is packed into
one sequence with positions restarting per sample and an attention that cannot see across samples; the LM
head and log-softmax run over chunks of tokens, each recomputed in the backward pass, so at most
`chunk x vocab` logits exist at a time.

Attention is the HF model's own modules with one attention function registered under transformers'
`AttentionInterface`: on CUDA torch's variable-length flash attention (`torch.nn.attention.varlen`), elsewhere
one SDPA call over the samples re-padded (exact; CPU runs are small). Calling the HF modules themselves, not
our own copy of their math, keeps every architecture detail transformers implements (Qwen3's q/k norms, rope
scaling, biases) and keeps the decoder layers the modules FSDP2 wraps.

Vision-language models (Qwen2-VL, Qwen2.5-VL; docs/multimodal.md): the micro-batch's images (`PackedImages`) go
through the model's vision tower inside the same forward, their merged-patch embeddings replace the image pad
tokens' embeddings in the stream, and the language model runs on those embeddings with per-sample M-RoPE
positions [3, T] (vision_language.mrope_positions for each prompt, `index + delta` after it).
"""

from __future__ import annotations

import dataclasses
import inspect
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface, AttentionMaskInterface

from rlflow.engines.core.sampling import scaled_logits
from rlflow.engines.models import invariant
from rlflow.engines.models.checkpointing import checkpoint_kwargs
from rlflow.engines.models.head_math import compiled, head_logits_grad, head_logprobs
from rlflow.engines.models.transfer import tensor_to_device
from rlflow.engines.models.ulysses import ContextSplit, exchange_heads, exchange_tokens, split_stream
from rlflow.engines.models.vision_language import is_vision_language, mrope_positions

ATTENTION = "rlflow_packed"
ATTENTION_CUDNN = "rlflow_packed_cudnn"  # train.attention_kernel cudnn: a one-sample stream through cuDNN's SDPA
ATTENTION_EXACT = "rlflow_packed_exact"  # rollout.true_on_policy: invariant.attention, sample by sample

try:  # torch >= 2.9 on CUDA: flash attention over cumulative sequence lengths, no padding, no mask
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # older torch: the padded SDPA fallback everywhere
    varlen_attn = None

_VARLEN_PARAMS = set(inspect.signature(varlen_attn).parameters) if varlen_attn is not None else set()


@dataclass
class PackedImages:
    """A micro-batch's images as the vision tower takes them, and where their embeddings go in the packed stream.
    An image two samples share (a GRPO group's prompt) is encoded once and placed twice."""

    pixel_values: torch.Tensor  # [patches, C*T*P*P]: the distinct images' patches, one image after another
    grid_thw: torch.Tensor  # [distinct images, 3] long
    tokens: list[int]  # merged patches (image tokens) of each distinct image
    order: list[int]  # which distinct image each image of the stream is, in stream order
    token_index: torch.Tensor  # [image tokens] long: stream index of each image token, in stream order

    def to(self, device: torch.device | str) -> PackedImages:
        return dataclasses.replace(self, pixel_values=tensor_to_device(self.pixel_values, device),
                                   grid_thw=tensor_to_device(self.grid_thw, device),
                                   token_index=tensor_to_device(self.token_index, device))


@dataclass
class PackedRows:
    """Where the tokens of a right-padded [rows, width] micro-batch sit in its packed stream of T tokens."""

    input_ids: torch.Tensor  # [T]
    position_ids: torch.Tensor  # [T], restarting at 0 for every sample
    cu_seqlens: torch.Tensor  # [rows + 1] int32: sample i is tokens cu_seqlens[i]:cu_seqlens[i+1]
    max_len: int
    rows: torch.Tensor  # [T] row of each token in the padded batch
    cols: torch.Tensor  # [T] its column
    shape: tuple[int, int]
    split: ContextSplit | None = None  # context parallelism: the stream is split over a CP group (ulysses.py)
    mrope: torch.Tensor | None = None  # [3, T] M-RoPE positions (vision-language models; `with_images`)
    images: PackedImages | None = None  # the stream's images (vision-language models; `with_images`)

    @classmethod
    def from_padded(cls, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> PackedRows:
        """Pack a right-padded batch (each row's tokens first, then padding)."""
        lengths = attention_mask.sum(-1)
        rows, cols = attention_mask.nonzero(as_tuple=True)
        cu = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
        return cls(input_ids[rows, cols], cols, cu, int(lengths.max()) if len(lengths) else 0, rows, cols,
                   tuple(input_ids.shape))

    def unpack(self, flat: torch.Tensor) -> torch.Tensor:
        """Per-token values [T] (or [T, K]) back into the padded [rows, width] (or [rows, width, K]) layout (0 at
        padding)."""
        out = flat.new_zeros(self.shape + tuple(flat.shape[1:]))
        out[self.rows, self.cols] = flat
        return out

    def to(self, device: torch.device | str) -> PackedRows:
        move = {k: tensor_to_device(v, device) if torch.is_tensor(v) else v for k, v in self.__dict__.items()}
        if self.images is not None:
            move["images"] = self.images.to(device)
        return PackedRows(**move)

    def with_images(self, row_images: list[list[int]], grid_thw: torch.Tensor, pixel_values: torch.Tensor,
                    image_token_id: int, merge: int) -> PackedRows:
        """The same stream with its images: `row_images[r]` lists the distinct images (rows of `grid_thw`, their
        patches in `pixel_values` one image after another) of padded row r in prompt order. Each row's first
        image pad tokens are its images' (one run of tokens_per_image per image, in order); its M-RoPE positions
        are mrope_positions up to its last image token and `index + delta` on all three components after it (an
        image pad token a policy samples later is text, as the rollout engine treats it)."""
        if len(row_images) != self.shape[0]:
            raise ValueError(f"with_images: images for {len(row_images)} rows, the micro-batch has {self.shape[0]}")
        per_image = (grid_thw.prod(-1) // (merge * merge)).tolist()
        bounds = self.cu_seqlens.tolist()
        mrope, token_index, order = [], [], []
        for r, images in enumerate(row_images):
            ids = self.input_ids[bounds[r]:bounds[r + 1]]
            pads = _image_token_runs(ids, [per_image[i] for i in images], image_token_id, r)
            end = int(pads[-1]) + 1 if images else 0
            pos, delta = mrope_positions(ids[:end].tolist(), grid_thw[images].tolist(), image_token_id, merge)
            text = torch.arange(end, len(ids)) + delta
            mrope.append(torch.cat([pos, text.expand(3, -1)], dim=1))
            token_index.append(pads + bounds[r])
            order.extend(images)
        stream = torch.cat(mrope, dim=1) if mrope else torch.zeros(3, 0, dtype=torch.long)
        images = PackedImages(pixel_values, grid_thw.long(), per_image, order,
                              torch.cat(token_index) if token_index else torch.zeros(0, dtype=torch.long))
        return dataclasses.replace(self, mrope=stream.to(self.input_ids.device), images=images)

    def split_over(self, group) -> PackedRows:
        """The same micro-batch with its stream split over a context-parallel group (padded to a multiple of its
        size; rows/cols still address the real tokens only)."""
        if self.mrope is not None:
            raise ValueError("context parallelism: a vision-language model's stream (images, M-RoPE positions) is "
                             "not split over a CP group (train.context_parallel 1)")
        ids, pos, cu, max_len, split = split_stream(self.input_ids, self.position_ids, self.cu_seqlens,
                                                    self.max_len, group)
        return PackedRows(ids, pos, cu, max_len, self.rows, self.cols, self.shape, split)


def _image_token_runs(ids: torch.Tensor, counts: list[int], image_token_id: int, row: int) -> torch.Tensor:
    """Indices in `ids` of the first sum(counts) image pad tokens, checked to be one unbroken run per image."""
    pads = (ids == image_token_id).nonzero().flatten()
    need = sum(counts)
    if len(pads) < need:
        raise ValueError(f"micro-batch row {row}: {len(pads)} image pad tokens (id {image_token_id}) for its "
                         f"{len(counts)} images, which take {need} (one per merged patch)")
    pads, start = pads[:need], 0
    for i, n in enumerate(counts):
        run = pads[start:start + n]
        if n and int(run[-1] - run[0]) != n - 1:
            raise ValueError(f"micro-batch row {row}: image {i}'s {n} pad tokens are not one run (the prompt's "
                             "image pads must be expanded as VisionProcessor.encode does)")
        start += n
    return pads


def _packed_attention(module, query, key, value, attention_mask, scaling=None, packed: PackedRows | None = None,
                      cudnn: bool = False, **_kwargs):
    """transformers' attention call for one packed sequence: query [1, H, T, D], key/value [1, KV, T, D];
    returns [1, T, H, D]. Each sample attends causally to itself only. `cudnn`: as causal_varlen_attention's."""
    if packed is None:
        raise RuntimeError(f"attn_implementation {ATTENTION!r} needs the packed layout (call it through PackedLM)")
    q, k, v = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, heads, D]
    if packed.split is not None:  # context parallel: this rank's heads over the whole stream, then back
        q, k, v = exchange_heads(q, k, v, packed.split)
        out = causal_varlen_attention(q, k, v, packed.cu_seqlens, packed.max_len, scaling, cudnn=cudnn)
        return exchange_tokens(out, packed.split).unsqueeze(0), None
    out = causal_varlen_attention(q, k, v, packed.cu_seqlens, packed.max_len, scaling, packed.rows, packed.cols,
                                  cudnn)
    return out.unsqueeze(0), None


def causal_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                            max_len: int, scale: float | None = None, rows: torch.Tensor | None = None,
                            cols: torch.Tensor | None = None, cudnn: bool = False) -> torch.Tensor:
    """Causal attention of packed samples, each seeing only itself: q [T, H, D], k/v [T, KV, D] (KV divides H),
    sample i at tokens cu_seqlens[i]:cu_seqlens[i+1]; returns [T, H, D]. Shared by every backend that packs.

    On CUDA with 16-bit inputs (or under autocast): torch's variable-length flash attention, or with `cudnn`
    (train.attention_kernel) a stream of one sample through cuDNN's SDPA kernel. Elsewhere one exact SDPA call
    over the samples re-padded; `rows`/`cols` (each token's sample and position) are derived from cu_seqlens when
    not given."""
    half = q.dtype if q.dtype in (torch.bfloat16, torch.float16) else (
        torch.get_autocast_dtype("cuda") if q.is_cuda and torch.is_autocast_enabled("cuda") else None)
    if q.is_cuda and half is not None and cudnn and len(cu_seqlens) == 2:
        return _cudnn_one_sample(q.to(half), k.to(half), v.to(half), scale)
    if q.is_cuda and varlen_attn is not None and half is not None:  # flash kernels take 16-bit inputs only
        return _varlen(q.to(half), k.to(half), v.to(half), cu_seqlens, max_len, scale)
    if rows is None or cols is None:
        lengths = cu_seqlens.diff().long()
        rows = torch.repeat_interleave(torch.arange(len(lengths), device=q.device), lengths)
        cols = torch.arange(q.shape[0], device=q.device) - cu_seqlens.long()[rows]
    return _padded_sdpa(q, k, v, len(cu_seqlens) - 1, max_len, rows, cols, scale)


def _padded_sdpa(q, k, v, samples: int, max_len: int, rows, cols, scale):
    """The exact fallback: the samples back in their right-padded rows, [samples, heads, max_len, D], for one
    causal SDPA call (padding sits after each sample's tokens, so the causal mask alone keeps every real query
    off it)."""

    def padded(x):
        out = x.new_zeros(samples, max_len, *x.shape[1:])
        out[rows, cols] = x
        return out.transpose(1, 2)

    out = F.scaled_dot_product_attention(padded(q), padded(k), padded(v), is_causal=True, scale=scale,
                                         enable_gqa=True)
    return out.transpose(1, 2)[rows, cols]


def _cudnn_one_sample(q, k, v, scale):
    """One causal sequence [T, H, D] through SDPA with cuDNN's kernel first (flash 2 if cuDNN cannot take it):
    without packing there is no varlen bookkeeping, and on Hopper cuDNN's fused attention is the faster kernel
    (torch's varlen API keeps its cuDNN path switched off). Grouped-query heads are repeated: 2 x T x H x D more
    bytes, small beside the T^2 work this is for."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION], set_priority=True):
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                             v.transpose(0, 1)[None], is_causal=True, scale=scale)
    return out[0].transpose(0, 1)


def _varlen(q, k, v, cu_seqlens, max_len, scale):
    """torch's varlen flash attention, causal; grouped-query heads are repeated where this torch's API lacks
    enable_gqa."""
    if "enable_gqa" not in _VARLEN_PARAMS and k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    kwargs = {"scale": scale}
    if "is_causal" in _VARLEN_PARAMS:
        kwargs["is_causal"] = True
    else:
        kwargs["window_size"] = (-1, 0)  # causal: no key to the right of the query
    if "enable_gqa" in _VARLEN_PARAMS:
        kwargs["enable_gqa"] = True
    return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, **kwargs)


EXACT_PAD_SLACK = 1.25  # rollout.true_on_policy: padded tokens of a group of samples at most this x its real ones
# ... and at most this many in all: on a GPU one call for many samples (a call per sample would be launch-bound);
# on a CPU a sample at a time (a small call's temporaries stay in cache, a large one's do not)
EXACT_GROUP_TOKENS = {"cuda": 1 << 16, "cpu": 0}


def _exact_packed_attention(module, query, key, value, attention_mask, scaling=None,
                            packed: PackedRows | None = None, **_kwargs):
    """rollout.true_on_policy's attention call: the samples in groups of similar length, each group right-padded
    to its longest and run through invariant.attention (causal), the op the rollout engine's prefill and decode run
    for the same position. A query's bits depend on its own prefix only, so the grouping changes nothing but the
    work: one call per sample would be a launch-bound loop of thousands, one padded batch of all samples would pay
    for the longest one in every row."""
    if packed is None:
        raise RuntimeError(f"attn_implementation {ATTENTION_EXACT!r} needs the packed layout (call it through "
                           "PackedLM)")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    bounds = packed.cu_seqlens.tolist()
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    outputs: dict[int, torch.Tensor] = {}
    for group in _length_groups(lengths, EXACT_GROUP_TOKENS.get(query.device.type, 0)):
        q, k, v = (_padded_group(x, bounds, group) for x in (query, key, value))
        out = invariant.attention(q, k, v, None, scale)
        outputs |= {i: out[r, :, :lengths[i]] for r, i in enumerate(group)}
    return torch.cat([outputs[i] for i in sorted(outputs)], dim=1).transpose(0, 1).unsqueeze(0), None


def _padded_group(x: torch.Tensor, bounds: list[int], group: list[int]) -> torch.Tensor:
    """The group's samples of a packed [1, heads, T, D] as right-padded rows [len(group), heads, longest, D] (the
    first sample is the longest; a sample alone is a view of the stream)."""
    if len(group) == 1:
        return x[:, :, bounds[group[0]]:bounds[group[0] + 1]]
    width = bounds[group[0] + 1] - bounds[group[0]]
    return torch.stack([F.pad(x[0, :, bounds[i]:bounds[i + 1]], (0, 0, 0, width - (bounds[i + 1] - bounds[i])))
                        for i in group])


def _length_groups(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Sample indices, longest first, in groups whose padding to their first (longest) sample keeps the padded
    tokens within EXACT_PAD_SLACK x the real ones and within `max_tokens` (a sample alone may exceed it); empty
    samples are left out."""
    groups: list[list[int]] = []
    real = 0
    for i in sorted((i for i, n in enumerate(lengths) if n), key=lambda i: -lengths[i]):
        padded = (len(groups[-1]) + 1) * lengths[groups[-1][0]] if groups else 0
        if groups and padded <= max_tokens and padded <= EXACT_PAD_SLACK * (real + lengths[i]):
            groups[-1].append(i)
            real += lengths[i]
        else:
            groups.append([i])
            real = lengths[i]
    return groups


AttentionInterface.register(ATTENTION, _packed_attention)
AttentionMaskInterface.register(ATTENTION, lambda *args, **kwargs: None)  # samples are split by cu_seqlens
AttentionInterface.register(ATTENTION_CUDNN, partial(_packed_attention, cudnn=True))
AttentionMaskInterface.register(ATTENTION_CUDNN, lambda *args, **kwargs: None)
AttentionInterface.register(ATTENTION_EXACT, _exact_packed_attention)
AttentionMaskInterface.register(ATTENTION_EXACT, lambda *args, **kwargs: None)


class PackedLM(torch.nn.Module):
    """A HF causal LM (or a *ForTokenClassification critic) run on packed samples.

    `forward` returns per-token results in the packed order: log p(token | prefix) and entropy of the
    policy, or the critic's values. It is an nn.Module of its own so that FSDP2 can shard it at the root
    (embeddings, final norm and head) with the decoder layers sharded one by one.
    """

    def __init__(self, model: torch.nn.Module, chunk_tokens: int = 4096, checkpoint_layers: str = "off",
                 compile_layers: bool = False, fused_head: bool = False, true_on_policy: bool = False,
                 attention_kernel: str = "flash"):
        """`checkpoint_layers` (train.activation_checkpointing): "off", "full" or "selective" (checkpointing.py).
        `true_on_policy` (rollout.true_on_policy): the model's ops become engines/models/invariant.py's, as the
        rollout engine's in that mode, so its log-probs equal the engine's bit for bit (unfused head math).
        `attention_kernel` (train.attention_kernel): "cudnn" runs one-sample streams through cuDNN's SDPA."""
        super().__init__()
        self.model, self.chunk_tokens, self.fused_head = model, chunk_tokens, fused_head and not true_on_policy
        self.exact = true_on_policy
        if true_on_policy:
            invariant.make_invariant(model)
        attention = ATTENTION_EXACT if true_on_policy else ATTENTION_CUDNN if attention_kernel == "cudnn" else ATTENTION
        # a vision-language model's vision tower keeps its own attention (its patches are not a causal stream)
        self.vision_language = is_vision_language(model.config)
        model.config._attn_implementation = {"": attention, "text_config": attention} if self.vision_language \
            else attention
        self.body = model.model.language_model if self.vision_language else model.model
        self.visual = model.model.visual if self.vision_language else None
        self.critic = hasattr(model, "score")
        if not self.critic and model.lm_head.bias is not None:
            raise ValueError("PackedLM: an LM head with a bias is not supported (Llama/Qwen heads have none)")
        if checkpoint_layers != "off":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs(checkpoint_layers))
        if compile_layers:  # each layer's forward alone (dynamic: the packed length changes every micro-batch);
            for layer in self.body.layers:  # FSDP2's gather hooks stay outside the compiled code
                layer.forward = torch.compile(layer.forward, dynamic=True)

    def forward(self, packed: PackedRows, temperature: float = 1.0, with_entropy: bool = False,
                other_ids: torch.Tensor | None = None, top_k: int = 0) -> tuple[torch.Tensor, ...]:
        """Policy: (logprobs [T], entropy [T] or None), aligned with the tokens: entry t is about token t given
        the tokens before it in its sample (0 at each sample's first token). Critic: (values [T], None), entry t
        the value of the state before token t. `other_ids` [T, K] (aligned with the tokens like the result):
        also the logprobs [T, K] of those ids at each position, from the same distributions, with their
        gradient (on-policy distillation's top-k terms), as a third result. `top_k` > 0 (no gradient): instead,
        the k likeliest tokens at each position, (ids [T, k], logprobs [T, k]) aligned the same way: a
        distillation teacher's top k. One method, so FSDP2's hooks on it gather the weights either way."""
        # use_cache=False: transformers otherwise builds a KV cache on every forward, training included (a copy of
        # each layer's keys and values, and per-layer cache state that made torch.compile recompile per layer
        # until its limit, then run the remaining layers eagerly)
        split = packed.split  # context parallelism: this rank runs its slice of the stream (ulysses.py)
        if split is not None and self.exact:
            raise ValueError("context parallelism with rollout.true_on_policy: the exact attention is not split")
        if split is not None and (top_k or other_ids is not None):
            raise ValueError("context parallelism: the top-k and other-ids log-probs of on-policy distillation are "
                             "not split over a CP group (train.context_parallel 1 for distill.loss forward_kl/jsd)")
        ids, positions = packed.input_ids, packed.position_ids
        if split is not None:
            ids, positions = split.local(ids), split.local(positions)
        if self.vision_language:
            hidden = self._vision_language_hidden(packed)
        else:
            hidden = self.body(input_ids=ids[None], position_ids=positions[None],
                               packed=packed, use_cache=False).last_hidden_state[0]
        if top_k:
            return self._top_k(packed, hidden, temperature, top_k)
        first = _first_tokens(packed)
        if self.critic:  # the head's output at t - 1 has seen x_<t
            values = self.model.score(hidden)[:, 0].float()
            return _aligned(values, first, split), None
        targets = torch.roll(packed.input_ids, -1)  # token t+1, read from hidden t (wrapped ends are masked)
        if split is not None:  # labels shifted on the whole stream, then cut: a slice's last token keeps its label
            targets = split.local(targets)
        if other_ids is not None:  # ids of token t+1's position, read from hidden t as well
            targets = torch.cat([targets[:, None], torch.roll(other_ids, -1, dims=0)], dim=1)
        hidden, weight = self._head_inputs(hidden)
        logprobs, entropy = ChunkedHeadLogprobs.apply(hidden, weight, targets, temperature, self.chunk_tokens,
                                                      with_entropy, self.fused_head, self.exact)
        entropy = _aligned(entropy, first, split) if with_entropy else None
        if other_ids is None:
            return _aligned(logprobs, first, split), entropy
        return _shift_right(logprobs[:, 0], first), entropy, _shift_right(logprobs[:, 1:], first)

    def _vision_language_hidden(self, packed: PackedRows) -> torch.Tensor:
        """The language model's last hidden states [T, d] of a vision-language stream: token embeddings with the
        images' embeddings at their pad tokens, M-RoPE positions per sample (text positions on all three
        components where the stream has no `with_images`)."""
        embeds = self.body.embed_tokens(packed.input_ids)
        embeds = self._place_images(embeds, packed.images)
        positions = packed.mrope if packed.mrope is not None else packed.position_ids.expand(3, -1)
        return self.body(inputs_embeds=embeds[None], position_ids=positions[:, None], packed=packed,
                         use_cache=False).last_hidden_state[0]

    def _place_images(self, embeds: torch.Tensor, images: PackedImages | None) -> torch.Tensor:
        """`embeds` [T, d] with each image token's row replaced by its merged-patch embedding. The vision tower
        runs on every micro-batch, one without images on a blank one-token image whose output is added times 0:
        under FSDP2 every rank must gather (and, trained, reduce) the vision units the same number of times, and
        another rank's micro-batch may hold images. A frozen tower runs without autograd (no activations kept)."""
        if images is None or not images.order:
            images = self._blank_image(embeds.device)
        frozen = not any(p.requires_grad for p in self.visual.parameters())
        with torch.no_grad() if frozen else nullcontext():
            result = self.visual(images.pixel_values, grid_thw=images.grid_thw)
            merged = getattr(result, "pooler_output", result)  # transformers >= 5.2 returns an output object
        if not images.order:
            return embeds + 0 * merged.sum().to(embeds.dtype)
        chunks = torch.split(merged, images.tokens)
        placed = torch.cat([chunks[i] for i in images.order]).to(embeds.dtype)
        if placed.shape[0] != images.token_index.shape[0]:
            raise ValueError(f"vision tower: {placed.shape[0]} image embeddings for {images.token_index.shape[0]} "
                             "image pad tokens")
        return embeds.index_put((images.token_index,), placed)

    def _blank_image(self, device: torch.device) -> PackedImages:
        """The smallest image the vision tower takes (one merged patch of zeros), placed nowhere."""
        vision = self.visual.config
        merge = vision.spatial_merge_size
        width = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
        return PackedImages(torch.zeros(merge * merge, width, device=device),
                            torch.tensor([[1, merge, merge]], device=device), [1], [],
                            torch.zeros(0, dtype=torch.long, device=device))

    @torch.no_grad()
    def _top_k(self, packed: PackedRows, hidden: torch.Tensor, temperature: float, k: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """The k likeliest next tokens at each position: (ids [T, k], logprobs [T, k]) aligned with the tokens
        (entry t: the distribution of token t given the tokens before it; 0 at each sample's first token), a
        chunk of [tokens, vocab] logits at a time."""
        hidden, weight = self._head_inputs(hidden)
        n = hidden.shape[0]
        ids = torch.zeros(n, k, dtype=torch.long, device=hidden.device)
        logprobs = torch.zeros(n, k, dtype=torch.float32, device=hidden.device)
        for a in range(0, n, self.chunk_tokens):
            top = _chunk_logp(hidden[a:a + self.chunk_tokens], weight, temperature).topk(k, dim=-1)
            logprobs[a:a + self.chunk_tokens], ids[a:a + self.chunk_tokens] = top.values, top.indices
        first = _first_tokens(packed)
        return _shift_right(ids, first), _shift_right(logprobs, first)

    def _head_inputs(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The hidden states and LM head weight in the dtype the head's matmuls run in (under autocast its
        dtype, backward included)."""
        device = hidden.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
        return hidden.to(dtype), self.model.lm_head.weight.to(dtype)


class ChunkedHeadLogprobs(torch.autograd.Function):
    """log p(target) (targets [T], or [T, M]: M per token) and entropy of softmax(scaled_logits(hidden @ weight.T,
    temperature)), chunk by chunk.

    The [tokens, vocab] logits of one chunk exist at a time: once in the forward pass, once again in the backward
    pass, where their gradient is formed and multiplied out at once. The per-chunk math is head_math's
    (`fused`: compiled into a few kernels on CUDA); the forward keeps each token's logsumexp, so the backward
    rebuilds p without another reduction. An output no loss uses gets no gradient (None, not zeros), so the
    backward pass needs no device sync to find out.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk, with_entropy, fused=False, exact=False):
        """`exact`: the chunk logits through invariant.linear (rollout.true_on_policy: the engine's LM head)."""
        ctx.set_materialize_grads(False)
        columns = targets if targets.dim() == 2 else targets[:, None]
        logprobs, lse, entropy = _chunked_stats(lambda a, b: _head_matmul(hidden[a:b], weight, exact), columns,
                                                temperature, chunk, with_entropy, fused, hidden, exact)
        ctx.save_for_backward(hidden, weight, columns, lse, entropy)
        ctx.temperature, ctx.chunk, ctx.fused, ctx.exact = temperature, chunk, fused, exact
        return logprobs.reshape(targets.shape), entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, columns, lse, entropy = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden)
        # a frozen head (LoRA, a teacher) needs no [V, d] fp32 gradient nor its GEMM per chunk
        grad_weight = (torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
                       if ctx.needs_input_grad[1] else None)
        if grad_logprobs is None:
            grad_logprobs = torch.zeros(columns.shape, dtype=torch.float32, device=hidden.device)
        grad_logprobs = grad_logprobs.reshape(columns.shape)
        grad_logits = _head_fn(head_logits_grad, ctx.fused, hidden)
        for a in range(0, hidden.shape[0], ctx.chunk):
            b = min(a + ctx.chunk, hidden.shape[0])
            dz = grad_logits(_head_matmul(hidden[a:b], weight, ctx.exact), columns[a:b], lse[a:b], entropy[a:b],
                             grad_logprobs[a:b],
                             None if grad_entropy is None else grad_entropy[a:b], ctx.temperature)
            grad_hidden[a:b] = dz @ weight
            if grad_weight is not None:
                grad_weight += (dz.T @ hidden[a:b]).float()
        return (grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype),
                None, None, None, None, None, None)


class ChunkedLogitsLogprobs(torch.autograd.Function):
    """ChunkedHeadLogprobs for logits a model's own output layer has already computed (the Megatron backend at
    tensor parallel 1): log p(targets [T, 1]) and entropy [T] of softmax(scaled_logits(logits [T, V], temperature)),
    a chunk of tokens at a time with head_math's functions (compiled on CUDA when `fused`). The logits are kept
    for the backward pass as they are; their gradient is written chunk by chunk in their dtype, with no fp32 copy
    of a chunk kept between the passes."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, chunk, with_entropy, fused=False):
        ctx.set_materialize_grads(False)
        logprobs, lse, entropy = _chunked_stats(lambda a, b: logits[a:b], targets, temperature, chunk, with_entropy,
                                                fused, logits)
        ctx.save_for_backward(logits, targets, lse, entropy)
        ctx.temperature, ctx.chunk, ctx.fused = temperature, chunk, fused
        return logprobs[:, 0], entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        logits, targets, lse, entropy = ctx.saved_tensors
        if grad_logprobs is None:
            grad_logprobs = torch.zeros(targets.shape[0], dtype=torch.float32, device=logits.device)
        grad_logits = _head_fn(head_logits_grad, ctx.fused, logits)
        grad = torch.empty_like(logits)
        for a in range(0, logits.shape[0], ctx.chunk):
            b = min(a + ctx.chunk, logits.shape[0])
            grad[a:b] = grad_logits(logits[a:b], targets[a:b], lse[a:b], entropy[a:b], grad_logprobs[a:b, None],
                                    None if grad_entropy is None else grad_entropy[a:b], ctx.temperature)
        return grad, None, None, None, None, None


def _chunked_stats(chunk_logits, columns: torch.Tensor, temperature: float, chunk: int, with_entropy: bool,
                   fused: bool, like: torch.Tensor, exact: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """head_math.head_logprobs over `chunk` tokens at a time, `chunk_logits(a, b)` giving tokens a:b's logits:
    (log p of `columns` [n, M], lse [n], entropy [n]), fp32, on `like`'s device; `exact` as head_logprobs'."""
    n, device = columns.shape[0], like.device
    stats = _head_fn(head_logprobs, fused, like)
    logprobs = torch.empty(columns.shape, dtype=torch.float32, device=device)
    lse = torch.empty(n, dtype=torch.float32, device=device)
    entropy = torch.zeros(n, dtype=torch.float32, device=device)
    for a in range(0, n, chunk):
        b = min(a + chunk, n)
        logprobs[a:b], lse[a:b], entropy[a:b] = stats(chunk_logits(a, b), columns[a:b], temperature, with_entropy,
                                                      exact)
    return logprobs, lse, entropy


def _head_matmul(hidden: torch.Tensor, weight: torch.Tensor, exact: bool) -> torch.Tensor:
    """A chunk's logits: one GEMM, or (exact) each token's row on its own (invariant.linear)."""
    return invariant.linear(hidden, weight) if exact else hidden @ weight.T


def _head_fn(fn, fused: bool, hidden: torch.Tensor):
    """head_math's `fn`, compiled where it runs fused (CUDA), else as written."""
    return compiled(fn) if fused and hidden.is_cuda else fn


def _chunk_logp(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.log_softmax(scaled_logits(hidden @ weight.T, temperature), dim=-1)


def _first_tokens(packed: PackedRows) -> torch.Tensor:
    """[T] True at each sample's first token of the packed stream."""
    first = torch.zeros_like(packed.input_ids, dtype=torch.bool)
    first[packed.cu_seqlens[:-1].long()] = True
    return first


def _aligned(x: torch.Tensor, first: torch.Tensor, split: ContextSplit | None) -> torch.Tensor:
    """Per-hidden-state results aligned with the tokens (_shift_right); split over a CP group, this rank's
    slice is first gathered with the others' and the stream's padding dropped."""
    if split is None:
        return _shift_right(x, first)
    return _shift_right(split.gather(x)[:split.tokens], first[:split.tokens])


def _shift_right(x: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """Row t of the result ([T] or [T, K]) is row t-1 of x, and 0 at each sample's first token."""
    out = torch.roll(x, 1, dims=0)
    mask = first if x.dim() == 1 else first[:, None]
    return torch.where(mask, torch.zeros_like(out), out)
