"""On-policy distillation: the reverse-KL loss by hand, its config, the teacher's vocabulary check and placement,
and a student that learns from a teacher through the whole loop (docs/distillation.md)."""

from __future__ import annotations

import math
import shutil

import mlflow
import pytest
import torch
from mlflow.tracking import MlflowClient

from bench.e2e.bare_loop import run_bare, run_sft_bare
from rlflow.engines.core import algorithms as A
from rlflow.engines.core.batch import pack_samples
from rlflow.engines.core.config import AlgorithmConfig, DistillConfig, TrainConfig, config_from_dict, load_recipe
from rlflow.engines.models.hf import load_model, load_tokenizer
from rlflow.engines.models.packed import PackedLM, PackedRows
from rlflow.engines.session.preflight import find_problems
from rlflow.engines.session.workers import check_teacher_vocabulary, role_demands
from rlflow.engines.train.torch_backend import TorchTrainBackend
from rlflow.flows.post_train import post_train
from tests.conftest import small_recipe, step_metrics

LN2 = math.log(2.0)


# ----------------------------------------------------------------------------- the loss, by hand


def _two_tokens():
    """One sequence of two trained tokens: the student gave them p = 1/2 and 1/4, the teacher q = 1/4 and 1/2."""
    p = torch.tensor([[math.log(0.5), math.log(0.25)]])
    q = torch.tensor([[math.log(0.25), math.log(0.5)]])
    return p, q, torch.ones(1, 2)


def test_policy_gradient_form_by_hand():
    """At the sampling policy (ratio 1) the loss is the token mean of k1 = log p - log q, and the gradient of each
    token's logprob is its k1 / 2: ln 2 and -ln 2 over 2 tokens (the sampled-token reverse-KL gradient)."""
    p, q, mask = _two_tokens()
    logp = p.clone().requires_grad_(True)
    loss, m = A.distill_loss(logp, p, q, mask, estimator="k1", policy_gradient=True)
    assert loss.item() == pytest.approx(0.0, abs=1e-6)  # (ln 2 - ln 2) / 2
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[LN2 / 2, -LN2 / 2]]), atol=1e-6)
    assert m["distill_kl"].item() == pytest.approx(0.0, abs=1e-6) and m["distill_clip_frac"].item() == 0.0
    # moved outside the clip range, a token whose advantage pushes it further gets no gradient (PPO-clip)
    moved = (p + torch.tensor([[0.0, 0.5]])).requires_grad_(True)  # token 2: ratio e^0.5 > 1.2, advantage ln 2 > 0
    A.distill_loss(moved, p, q, mask, policy_gradient=True)[0].backward()
    assert moved.grad[0, 1].item() == 0.0 and moved.grad[0, 0].item() == pytest.approx(LN2 / 2, abs=1e-6)


@pytest.mark.parametrize("estimator, value, grad", [
    # k2 = (log p - log q)^2 / 2 = ln^2 2 / 2 per token; its gradient log p - log q = +-ln 2, / 2 tokens
    ("k2", 0.5 * LN2**2, [LN2 / 2, -LN2 / 2]),
    # k3 = q/p - ln(q/p) - 1: 0.5 + ln 2 - 1 and 2 - ln 2 - 1 (mean 0.25); gradient 1 - q/p: 0.5 and -1, / 2
    ("k3", 0.25, [0.25, -0.5]),
    # k1 = +-ln 2 (mean 0); its gradient is 1 per token whatever the teacher says: / 2
    ("k1", 0.0, [0.5, 0.5]),
])
def test_direct_estimators_by_hand(estimator, value, grad):
    p, q, mask = _two_tokens()
    logp = p.clone().requires_grad_(True)
    loss, m = A.distill_loss(logp, p, q, mask, estimator=estimator, policy_gradient=False)
    assert loss.item() == pytest.approx(value, abs=1e-6) and "distill_clip_frac" not in m
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([grad]), atol=1e-6)


def test_off_mask_teacher_values_never_reach_the_loss():
    """Padding and prompt positions may hold anything (-inf, NaN): neither the loss nor a gradient sees them."""
    p, q, _ = _two_tokens()
    mask = torch.tensor([[1.0, 0.0]])
    bad_q = torch.tensor([[math.log(0.25), float("nan")]])
    for pg in (True, False):
        logp = p.clone().requires_grad_(True)
        loss, m = A.distill_loss(logp, p, bad_q, mask, estimator="k2", policy_gradient=pg)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(logp.grad).all() and logp.grad[0, 1] == 0.0
        assert m["distill_kl"].item() == pytest.approx(LN2, abs=1e-6)  # token 1 only: ln 0.5 - ln 0.25
    with pytest.raises(ValueError, match="unknown estimator 'k9'"):
        A.distill_loss(p, p, q, mask, estimator="k9")


def test_rl_loss_adds_the_teacher_term_or_keeps_it_alone():
    """added: the policy loss + coef x distill_loss; alone: only the distillation term (pg_loss still reported);
    without teacher logprobs a distilling loss is an error, not a silent RL-only step."""
    p, q, mask = _two_tokens()
    kw = {"clip_low": 0.2, "clip_high": 0.2, "loss_agg": "token_mean"}
    adv = torch.ones(1)
    plain, m0 = A.rl_loss(p, p, adv, mask, **kw)
    distill, _ = A.distill_loss(p, p, q, mask, estimator="k2", policy_gradient=False)
    cfg = DistillConfig(teacher_path="teacher", estimator="k2", policy_gradient=False, coef=0.5)
    added, m1 = A.rl_loss(p, p, adv, mask, teacher_logprobs=q, **kw, **cfg.loss_kwargs())
    assert added.item() == pytest.approx(plain.item() + 0.5 * distill.item(), abs=1e-6)
    assert m1["pg_loss"].item() == pytest.approx(m0["pg_loss"].item()) and "distill_kl" in m1
    alone_cfg = cfg.model_copy(update={"mode": "alone"})
    alone, m2 = A.rl_loss(p, p, adv, mask, teacher_logprobs=q, **kw, **alone_cfg.loss_kwargs())
    assert alone.item() == pytest.approx(0.5 * distill.item(), abs=1e-6) and m2["loss"] == alone
    assert DistillConfig().loss_kwargs() == {}  # no teacher: rl_loss is untouched
    with pytest.raises(ValueError, match="needs teacher_logprobs"):
        A.rl_loss(p, p, adv, mask, **kw, **cfg.loss_kwargs())


def test_topk_forward_kl_and_jsd_by_hand():
    """Over the teacher's top 2 of 3 tokens, q = (1/2, 1/4) and the student's p = (1/4, 1/4) at those ids."""
    q = torch.tensor([[[math.log(0.5), math.log(0.25)]]])
    p = torch.tensor([[[math.log(0.25), math.log(0.25)]]], requires_grad=True)
    mask = torch.ones(1, 1)
    # forward KL: 1/2 ln 2 + 1/4 ln 1 = ln 2 / 2; gradient -q_k: (-1/2, -1/4); teacher mass 3/4
    loss, m = A.topk_distill_loss(p, q, mask, loss="forward_kl")
    loss.backward()
    assert loss.item() == pytest.approx(LN2 / 2, abs=1e-6) and m["distill_teacher_mass"].item() == pytest.approx(0.75)
    assert torch.allclose(p.grad, torch.tensor([[[-0.5, -0.25]]]), atol=1e-6)
    # jsd, beta 1/2: m = (3/8, 1/4); 1/2 [1/2 ln(4/3) + 0] + 1/2 [1/4 ln(2/3) + 0]
    jsd, m = A.topk_distill_loss(p, q, mask, loss="jsd", beta=0.5)
    assert jsd.item() == pytest.approx(0.25 * math.log(4 / 3) + 0.125 * math.log(2 / 3), abs=1e-6)
    assert m["distill_kl"].item() == pytest.approx(LN2 / 2, abs=1e-6)  # the forward KL, whichever the loss
    with pytest.raises(ValueError, match="0 < beta < 1"):
        A.topk_distill_loss(p, q, mask, loss="jsd", beta=1.0)


def test_topk_over_the_whole_vocabulary_is_the_forward_kl():
    """With k = V the top-k forward KL is the full KL(teacher || student), and NaN off the mask stays out."""
    g = torch.Generator().manual_seed(0)
    student = torch.log_softmax(torch.randn(2, 3, 5, generator=g), -1)
    teacher = torch.log_softmax(torch.randn(2, 3, 5, generator=g), -1)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    teacher[0, 2] = float("nan")
    loss, _ = A.topk_distill_loss(student, teacher, mask, loss="forward_kl")
    full = (teacher.exp() * (teacher - student)).sum(-1)
    assert loss.item() == pytest.approx(float(full[mask > 0].mean()), abs=1e-6)


def test_packed_head_gives_other_ids_logprobs_with_their_gradient(tiny_model_dir):
    """PackedLM's logprobs of extra ids per position (the teacher's top k) are the HF model's log-softmax at those
    ids, and their gradient is the same as through the HF model's full logits."""
    ref, model = load_model(tiny_model_dir), load_model(tiny_model_dir)
    ids = torch.tensor([[1, 5, 6, 7, 8], [1, 9, 10, 0, 0]])
    attn = (torch.arange(5) < torch.tensor([[5], [3]])).long()
    other = torch.randint(0, ref.config.vocab_size, (2, 5, 3), generator=torch.Generator().manual_seed(0))
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    logp = torch.log_softmax(ref(ids, attention_mask=attn, position_ids=pos).logits.float() / 0.7, -1)
    want = torch.zeros(2, 5, 3)
    want[:, 1:] = logp[:, :-1].gather(-1, other[:, 1:])  # position t: the distribution of token t
    want = want * attn[..., None]
    packed = PackedRows.from_padded(ids, attn)
    lp, _, got = PackedLM(model, chunk_tokens=4)(packed, 0.7, other_ids=other[packed.rows, packed.cols])
    got = packed.unpack(got)
    assert (got - want).abs().max() < 1e-5
    weights = torch.randn(2, 5, 3, generator=torch.Generator().manual_seed(1))
    ((got * weights).sum() + packed.unpack(lp).sum()).backward()
    ref_lp = torch.zeros(2, 5)
    ref_lp[:, 1:] = logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    ((want * weights).sum() + (ref_lp * attn).sum()).backward()
    for (name, a), b in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, atol=1e-5, rtol=1e-4), name


def test_teacher_topk_is_the_models_likeliest_tokens(tiny_model_dir):
    """forward_topk: ids and logprobs of the k likeliest next tokens at each position, as torch.topk of the HF
    model's log-softmax gives them, aligned with the tokens."""
    teacher = TorchTrainBackend(tiny_model_dir, TrainConfig(threads=1), AlgorithmConfig(), role="teacher",
                                temperature=0.7)
    batch = pack_samples([[1, 5, 6], [1, 7]], [[8, 9, 2], [10, 2]], [[-1.0] * 3, [-1.0] * 2], torch.zeros(2), 0)
    ids, logprobs = teacher.forward_topk(batch, 4)
    hf = load_model(tiny_model_dir)
    attn = batch["attention_mask"]
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    logp = torch.log_softmax(hf(batch["input_ids"], attention_mask=attn, position_ids=pos).logits.float() / 0.7, -1)
    top = logp[:, :-1].topk(4, dim=-1)
    valid = attn[:, 1:].bool()
    assert torch.equal(ids[:, 1:][valid], top.indices[valid])
    assert (logprobs[:, 1:][valid] - top.values[valid]).abs().max() < 1e-5
    assert ids[:, 0].eq(0).all() and logprobs[:, 0].eq(0).all()


# ----------------------------------------------------------------------------- config, vocabulary, placement


def test_distill_config_errors_name_the_field(tmp_path):
    with pytest.raises(ValueError, match=r"distill.teacher_path: distill.coef, distill.mode set without a teacher"):
        config_from_dict(small_recipe(tmp_path, distill={"coef": 0.5, "mode": "alone"}))
    with pytest.raises(ValueError, match="distill.loss"):
        config_from_dict(small_recipe(tmp_path, distill={"teacher_path": "t", "loss": "tvd"}))
    with pytest.raises(ValueError, match=r"distill.beta: does not apply to distill.loss 'forward_kl'"):
        config_from_dict(small_recipe(tmp_path, distill={"teacher_path": "t", "loss": "forward_kl", "beta": 0.3}))
    with pytest.raises(ValueError, match=r"distill.estimator: does not apply to distill.loss 'jsd'"):
        config_from_dict(small_recipe(tmp_path, distill={"teacher_path": "t", "loss": "jsd", "estimator": "k3"}))
    with pytest.raises(ValueError, match=r"distill.top_k: does not apply to distill.loss 'reverse_kl'"):
        config_from_dict(small_recipe(tmp_path, distill={"teacher_path": "t", "top_k": 8}))
    with pytest.raises(ValueError, match="beta"):
        config_from_dict(small_recipe(tmp_path, distill={"teacher_path": "t", "loss": "jsd", "beta": 1.0}))
    with pytest.raises(ValueError, match="train.backend megatron offers reverse_kl only"):
        config_from_dict(small_recipe(tmp_path, distill={"teacher_path": "t", "loss": "jsd"},
                                      train={"backend": "megatron", "steps": 3, "threads": 1}))
    with pytest.raises(ValueError, match="distill.num_workers: the step's samples.*= 32.*3 teacher workers"):
        config_from_dict(small_recipe(tmp_path, distill={"teacher_path": "t", "num_workers": 3}))
    with pytest.raises(ValueError, match="distill.mode: alone drops the RL loss"):
        config_from_dict(small_recipe(tmp_path, distill={"teacher_path": "t", "mode": "alone"},
                                      algorithm={"advantage": "gae"}))
    with pytest.raises(ValueError, match="coef"):
        config_from_dict(small_recipe(tmp_path, distill={"teacher_path": "t", "coef": 0}))


def test_teacher_vocabulary_must_be_the_students(tiny_model_dir, tmp_path):
    """Another tokenizer (one token more) or an embedding without a row per token is refused by name."""
    check_teacher_vocabulary(tiny_model_dir, tiny_model_dir)
    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    tok = load_tokenizer(other)
    tok.add_tokens(["<tool>"])
    tok.save_pretrained(other)
    with pytest.raises(ValueError, match=r"distill.teacher_path: the teacher's tokenizer .* is not the student's"):
        check_teacher_vocabulary(tiny_model_dir, str(other))
    with pytest.raises(ValueError, match="distill.teacher_path: the teacher's embedding has"):
        check_teacher_vocabulary(str(other), str(other))  # the same tokenizer, one token past the embedding
    # `rlflow validate` reports both, with a missing teacher, before anything starts
    raw = small_recipe(tmp_path, model={"path": tiny_model_dir})
    assert find_problems(config_from_dict({**raw, "distill": {"teacher_path": str(tmp_path / "nope")}})) == [
        f"distill.teacher_path: no Hugging Face model (config.json) in {tmp_path}/nope"]
    problems = find_problems(config_from_dict({**raw, "distill": {"teacher_path": str(other)}}))
    assert len(problems) == 1 and "is not the student's" in problems[0]
    assert find_problems(config_from_dict({**raw, "distill": {"teacher_path": tiny_model_dir}})) == []


def test_teacher_is_its_own_role_with_its_gpus(tmp_path):
    """The teacher gets its own placement group (colocated runs too), with distill.gpus_per_worker on cuda."""
    raw = small_recipe(tmp_path, distill={"teacher_path": "t", "num_workers": 2, "gpus_per_worker": 0.5},
                       train={"device": "cuda", "steps": 3, "threads": 1, "num_workers": 2},
                       rollout={"num_workers": 2}, cluster={"use_ray": True, "colocate": True})
    demands = {d.field: d for d in role_demands(config_from_dict(raw), 2, 2, False, True)}
    assert demands["teacher"].workers == 2 and demands["teacher"].bundle["GPU"] == 0.5
    assert set(demands) == {"train", "teacher"}


def test_teacher_role_is_frozen_and_scores_like_a_policy(tiny_model_dir):
    """The teacher worker is the torch backend's logprob pass on frozen weights: the same logprobs as a policy
    worker of the same model (fp32), its weights in the teacher's precision (bf16), and no train step."""
    batch = pack_samples([[1, 5, 6], [1, 7]], [[8, 9, 2], [10, 2]], [[-1.0] * 3, [-1.0] * 2], torch.zeros(2), 0)
    policy = TorchTrainBackend(tiny_model_dir, TrainConfig(threads=1), AlgorithmConfig())
    teacher = TorchTrainBackend(tiny_model_dir, TrainConfig(threads=1), AlgorithmConfig(), role="teacher")
    mask = batch["attention_mask"].bool()
    assert torch.allclose(teacher.forward_logprobs(batch)[mask], policy.forward_logprobs(batch)[mask], atol=1e-6)
    assert not any(p.requires_grad for p in teacher.model.parameters())
    bf16 = TorchTrainBackend(tiny_model_dir, TrainConfig(threads=1, precision="bf16"), AlgorithmConfig(),
                             role="teacher")
    assert {p.dtype for p in bf16.model.parameters()} == {torch.bfloat16}
    with pytest.raises(ValueError, match="distillation teacher; it only scores"):
        teacher.train_step({**batch, "advantages": torch.zeros(2)})


@pytest.mark.slow
def test_teacher_workers_as_ray_actors_beside_two_train_workers(tmp_path):
    """Two teacher actors in their own placement group score beside two train workers (mode added); ~35 s."""
    raw = small_recipe(tmp_path, cluster={"use_ray": False}, eval={"every": 0}, train={"steps": 3, "threads": 1})
    teacher = _sft_teacher(tmp_path, raw, 10, hidden_size=64, num_layers=3, intermediate_size=128)
    cfg = config_from_dict({**raw, "cluster": {"use_ray": True, "cpus_per_worker": 0.25},
                            "train": {"steps": 3, "threads": 1, "num_workers": 2},
                            "distill": {"teacher_path": teacher, "num_workers": 2}})
    history = run_bare(cfg, str(tmp_path), log=lambda line: None, use_ray=True)
    # measured: distill/kl 0.33, 0.22, 0.30; with policy_gradient and ratio 1 the loss equals the KL estimate
    assert all(m["distill/kl"] > 0 and m["train/distill_loss"] == pytest.approx(m["distill/kl"], rel=0.2, abs=0.02)
               for m in history), history


# ----------------------------------------------------------------------------- the student learns


def _sft_teacher(tmp_path, raw: dict, steps: int, examples: int = 1024, lr: float = 3e-3, **model) -> str:
    """A teacher of another size than the student, taught the task by SFT on `examples` correct answers."""
    raw = {**raw, "model": {**raw["model"], **model}, "cluster": {"use_ray": False},
           "sft": {"train_path": str(tmp_path / "data/sft.jsonl"), "batch_size": 64, "lr": lr, "steps": steps,
                   "generate": {**raw["data"]["generate"], "num_train": examples}}}
    return str(run_sft_bare(config_from_dict(raw), tmp_path / "teacher_base", tmp_path / "teacher"))


def test_student_moves_toward_the_teacher_through_the_flow(tmp_path):
    """distill alone, through the Prefect flow: the teacher stage runs each step, the reverse KL on the student's
    own samples falls, the student's samples get likelier under the teacher, and distill/* reach MLflow."""
    steps = 20
    raw = small_recipe(tmp_path, cluster={"use_ray": False}, eval={"every": 0},
                       train={"steps": steps, "threads": 1, "lr": 3e-3, "mini_batches": 4, "epochs": 2},
                       rollout={"prompts_per_step": 32, "samples_per_prompt": 4, "max_new_tokens": 4})
    raw["model"]["hidden_size"] = 64
    teacher = _sft_teacher(tmp_path, raw, 40, hidden_size=96, num_layers=3, intermediate_size=192)
    cfg = config_from_dict({**raw, "distill": {"teacher_path": teacher, "mode": "alone"}})
    seen, _ = step_metrics(lambda: post_train(cfg))
    kl = [seen[s]["distill/kl"] for s in range(steps)]
    teacher_lp = [seen[s]["distill/teacher_logprob_mean"] for s in range(steps)]
    print("distill/kl", [round(k, 3) for k in kl], "teacher logprob", [round(t, 3) for t in teacher_lp])
    # measured (seed 0, a 64-wide student, a 96-wide 3-layer teacher after 40 SFT steps): the reverse KL 3.06 -> 1.95
    # (means of the first and last 3 steps), the teacher's logprob of the student's tokens -5.89 -> -3.73; without
    # the teacher term the loss of mode alone is 0 and nothing moves
    assert sum(kl[-3:]) < 0.75 * sum(kl[:3]), kl
    assert sum(teacher_lp[-3:]) > sum(teacher_lp[:3]) + 3 * 1.0, teacher_lp
    assert all("time/teacher" in seen[s] and "train/distill_loss" in seen[s] for s in range(steps))
    client = MlflowClient(cfg.tracking.uri)
    run = client.search_runs([client.get_experiment_by_name(cfg.tracking.experiment).experiment_id])[0]
    for key in ("distill/kl", "train/distill_kl", "train/distill_loss"):
        assert len(client.get_metric_history(run.info.run_id, key)) == steps, key
    mlflow.set_tracking_uri(None)


@pytest.mark.parametrize("loss", ["forward_kl", "jsd"])
def test_topk_losses_move_the_student_toward_the_teacher(tmp_path, loss):
    """forward_kl / jsd over the teacher's top 8 (bare loop, mode alone): the top-k forward KL falls and the
    student's sampled tokens land in the teacher's top 8 more often. Measured (seed 0, 20 steps, first 3 -> last 3
    steps): forward_kl 1.75 -> 0.14 and 0.56 -> 0.98 in the top 8; jsd 2.01 -> 0.49 and 0.46 -> 0.85; ~8 s each."""
    raw = small_recipe(tmp_path, cluster={"use_ray": False}, eval={"every": 0},
                       train={"steps": 20, "threads": 1, "lr": 3e-3, "mini_batches": 4, "epochs": 2},
                       rollout={"prompts_per_step": 32, "samples_per_prompt": 4, "max_new_tokens": 4})
    raw["model"]["hidden_size"] = 64
    teacher = _sft_teacher(tmp_path, raw, 40, hidden_size=96, num_layers=3, intermediate_size=192)
    cfg = config_from_dict({**raw, "distill": {"teacher_path": teacher, "mode": "alone", "loss": loss, "top_k": 8}})
    history = run_bare(cfg, str(tmp_path), log=lambda line: None)
    kl = [m["train/distill_kl"] for m in history]
    inside = [m["distill/sampled_in_topk"] for m in history]
    assert sum(kl[-3:]) < 0.4 * sum(kl[:3]), kl
    assert sum(inside[-3:]) > sum(inside[:3]) + 3 * 0.2, inside
    assert all(0.9 < m["distill/teacher_topk_mass"] <= 1.0 for m in history)


@pytest.mark.slow
def test_distillation_alone_learns_the_task_in_40_steps(tmp_path):
    """The demo (deployments/sort-tiny-distill.yaml: sort-tiny's student, no task reward in the loss) taught by a
    larger SFT'd teacher reaches held-out reward >= 0.93 in its 40 steps, where GRPO on the reward is near 0.82 at
    step 40 of its 100. Not the GRPO demo's 0.95: over 4 runs the 40-step run ends at 0.946 (2 cores, torch 2.13,
    seed 0) and 0.958 / 0.953 / 0.952 (seeds 0-2, torch 2.11, bench/cpu/distill_demo.py), 50 steps at 0.946 and
    0.964 / 0.971 / 0.960; a float-rounding change in the head's gradient (e5a8fa9) moved it from 0.964 to 0.946
    (docs/distillation.md). ~110 s with the teacher's SFT on an idle 2-core machine."""
    data = [f"data.train_path={tmp_path}/data/train.jsonl", f"data.eval_path={tmp_path}/data/eval.jsonl"]
    base = load_recipe("deployments/sort-tiny.yaml", data)
    teacher = _sft_teacher(tmp_path, base.model_dump(mode="json"), 300, examples=4096, lr=2e-3, hidden_size=192,
                           num_layers=3, intermediate_size=384)
    cfg = load_recipe("deployments/sort-tiny-distill.yaml", [
        *data, f"distill.teacher_path={teacher}", "checkpoint.every=0", "cluster.use_ray=false"])
    history = run_bare(cfg, str(tmp_path), log=lambda line: None)
    evals = [m["eval/reward_mean"] for m in history if "eval/reward_mean" in m]
    print("eval/reward_mean", evals)
    assert history[0]["rollout/reward_mean"] < 0.3 and max(evals) >= 0.93, evals
