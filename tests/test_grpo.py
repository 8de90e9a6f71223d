"""lit_qlora/train/grpo.py against TRL 1.16's own GRPOTrainer code: on the same prompts, completions, reward functions
and weights, TRL's `_generate_and_score_completions` (its sampler stubbed to return the given completions) and
`_compute_loss` run on a bare trainer object holding the settings they read; the model they call is our GPT (its full
logits, divided by the temperature, through the interface of TRL's fused head), so both sides differentiate the same
LoRA weights. Equal: the advantages, the sampling policy's and the reference's log-probabilities, the loss, the LoRA
gradients and the metrics, for every loss type, with and without beta, with num_iterations 2 and the adapter moved
between sampling and update (so the clip acts)."""
from __future__ import annotations

import math
from collections import defaultdict, deque
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch
from helpers import converted_tiny, lora_cfg, randomize_lora

from lit_qlora.loader import load_model
from lit_qlora.lora import lora_modules
from lit_qlora.train import grpo as gr
from lit_qlora.train.rewards import Reward, score

trl = pytest.importorskip("trl")
from trl.trainer.grpo_trainer import GRPOTrainer  # noqa: E402
from trl.trainer.utils import FusedCausalLMOutput  # noqa: E402

EOS, PAD, G, MAX_LEN, TEMPERATURE = 2, 0, 4, 6, 0.7
PROMPTS = [[11, 12, 13], [21, 22, 23, 24, 25]]
COMPLETIONS = [[31, 32, EOS], [33, 34, 35, 36, 37, 38], [39, EOS], [40, 41, 42, 43, EOS],  # group 1: one cut
               [51, 52, 53, 54, 55, 56], [57, 58, 59, EOS], [60, 61, 62, 63, 64, 65], [66, 67, 68, 69, EOS]]
COLUMN = [3.0, 5.0]  # a column of each prompt's row, passed to the reward functions


def decode(ids: list[int]) -> str:
    return " ".join(str(i) for i in ids if i not in (EOS, PAD))


def parity(prompts, completions, completion_ids, scale, **kw):
    """A reward of the tokens and a column; None (not scored) for one completion."""
    return [None if ids[0] == 39 else (sum(ids) % 7) / 7 * s for ids, s in zip(completion_ids, scale)]


def brevity(prompts, completions, completion_ids, **kw):
    return [-len(c.split()) / 3 for c in completions]


REWARDS = [Reward("parity", parity, 1.0), Reward("brevity", brevity, 0.5)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return converted_tiny(tmp_path_factory, "llama", "grpo-llama")


def policy(tiny, seed: int = 3):
    model = load_model(tiny.folder, precision="32-true", lora=lora_cfg(query=True, value=True, mlp=True), seed=0)
    randomize_lora(model, seed=seed)
    return model.train()


def grads(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, m in lora_modules(model).items():
        out[f"{name}.A"], out[f"{name}.B"] = m.lora_A.grad.clone(), m.lora_B.grad.clone()
        m.lora_A.grad = m.lora_B.grad = None
    return out


def move(model, seed: int = 11, by: float = 0.3) -> None:
    """An 'optimizer step': the adapter moves, so the ratios to the sampling policy leave 1 (and some get clipped)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_B.add_(torch.randn(m.lora_B.shape, generator=g) * by)


# ---- TRL's side -----------------------------------------------------------------------------------------------------
class FusedHead:
    """Our GPT as TRL calls a model patched by add_fused_lm_head: per-token log-probabilities of the labels at the
    temperature (0 where the label is -100), from the full logits of each row's real (attended) tokens."""

    is_gradient_checkpointing = False

    def __init__(self, gpt, training: bool = True) -> None:
        self.gpt, self.training = gpt, training

    def __call__(self, input_ids, attention_mask, labels, fused_lm_head, **kw):
        lab = labels[:, 1:]
        rows = []
        for b in range(input_ids.size(0)):
            real = attention_mask[b].nonzero()[:, 0]
            s, e = int(real[0]), int(real[-1]) + 1
            logp = (self.gpt(input_ids[b, s:e][None])[0] / TEMPERATURE).log_softmax(-1)
            row = torch.zeros(lab.size(1))
            for p in range(s, e - 1):
                if lab[b, p] != -100:
                    row = row.index_put((torch.tensor([p]),), logp[p - s, lab[b, p]].reshape(1))
            rows.append(row)
        lp = torch.stack(rows)
        return FusedCausalLMOutput(log_probs=lp, entropy=torch.zeros_like(lp).detach())


class Accelerator:
    device = torch.device("cpu")
    num_processes, process_index, is_main_process = 1, 0, True

    @staticmethod
    def gather(t):
        return t

    @staticmethod
    def reduce(t, reduction="sum"):
        return t

    @staticmethod
    def autocast():
        return nullcontext()


def bare_trainer(model, ref_model, loss_type: str, beta: float, scale: str, mask_truncated: bool, epsilon_high):
    t = GRPOTrainer.__new__(GRPOTrainer)  # no __init__: only the settings TRL's code reads
    args = SimpleNamespace(steps_per_generation=1, gradient_accumulation_steps=1, per_device_train_batch_size=len(
        COMPLETIONS), per_device_eval_batch_size=len(COMPLETIONS), use_bias_correction_kl=False, delta=None,
        gradient_checkpointing_kwargs=None, report_to=[])
    t.__dict__.update(
        accelerator=Accelerator(), args=args, model=model, ref_model=ref_model, rollout_func=None, use_vllm=False,
        vllm_importance_sampling_correction=False, tools=None, environment_factories=None, environments=None,
        processing_class=SimpleNamespace(batch_decode=lambda ids, skip_special_tokens: [decode(i) for i in ids]),
        _tokenizer=SimpleNamespace(pad_token_id=PAD), eos_token_ids=[EOS], pad_to_multiple_of=None,
        mask_truncated_completions=mask_truncated, num_generations=G, num_generations_eval=G, num_iterations=2,
        beta=beta, loss_type=loss_type, epsilon_low=0.2, epsilon_high=0.2 if epsilon_high is None else epsilon_high,
        scale_rewards=scale, multi_objective_aggregation="sum_then_normalize", max_completion_length=MAX_LEN,
        reward_funcs=[r.fn for r in REWARDS], reward_processing_classes=[None] * len(REWARDS),
        reward_func_names=[r.name for r in REWARDS], reward_weights=torch.tensor([r.weight for r in REWARDS]),
        state=SimpleNamespace(num_input_tokens_seen=0, global_step=0), _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _logs={"images": deque(), "prompt": deque(), "completion": deque(), "rewards": defaultdict(deque),
               "advantages": deque(), "extra": defaultdict(deque)},
        _pending_extra_logs=defaultdict(list), _pending_metrics=defaultdict(list), log_multimodal=False,
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token",
        current_gradient_accumulation_steps=1, _entropy_bonus_enabled=False, aux_loss_enabled=False)
    t._tokenize_prompts = lambda prompts: ([PROMPTS[i // G] for i in range(len(prompts))], None, {})
    t._generate_single_turn = lambda prompt_ids, images, fields, n: ([list(c) for c in COMPLETIONS], None)
    return t


def trl_run(tiny, loss_type, beta, scale, mask_truncated, epsilon_high=None):
    """TRL's scoring at the sampling policy, then its loss after the adapter moved: (loss, grads, inputs, metrics)."""
    model, base = policy(tiny), load_model(tiny.folder, precision="32-true")
    t = bare_trainer(FusedHead(model), FusedHead(base, False), loss_type, beta, scale, mask_truncated, epsilon_high)
    rows = [{"prompt": decode(PROMPTS[i // G]), "scale": COLUMN[i // G]} for i in range(len(COMPLETIONS))]
    inputs = GRPOTrainer._generate_and_score_completions(t, rows)
    move(model)
    loss = GRPOTrainer._compute_loss(t, FusedHead(model), inputs)
    loss.backward()
    return loss.detach(), grads(model), inputs, {k: v[-1] for k, v in t._metrics["train"].items()}


# ---- ours ------------------------------------------------------------------------------------------------------------
def our_run(tiny, loss_type, beta, scale, mask_truncated, epsilon_high=None):
    model = policy(tiny)
    reference = {n: torch.zeros_like(p) if "lora_B" in n else p.detach().clone()  # the fresh adapter: the base
                 for n, p in model.named_parameters() if p.requires_grad}
    completions = [gr.Completion(c, "stop" if c[-1] == EOS else "length") for c in COMPLETIONS]
    rows = [i // G for i in range(len(COMPLETIONS))]
    per_func = score(REWARDS, [decode(PROMPTS[r]) for r in rows], [decode(c) for c in COMPLETIONS], COMPLETIONS,
                     {"scale": [COLUMN[r] for r in rows]}, [f"row {r + 1}" for r in rows])
    adv, metrics = gr.advantages(per_func, torch.tensor([r.weight for r in REWARDS]), G, scale)
    metrics.update(gr.reward_metrics(per_func, [r.name for r in REWARDS]))
    metrics.update(gr.length_metrics(torch.tensor([len(c) for c in COMPLETIONS]),
                                     torch.tensor([c.finish_reason == "length" for c in completions])))
    kw = dict(temperature=TEMPERATURE, lm_head_chunk=0, device="cpu")
    with torch.no_grad():
        old = gr.token_logps(model.eval(), PROMPTS, COMPLETIONS, G, **kw)
        with gr.swapped_adapter(model, reference):
            ref = gr.token_logps(model, PROMPTS, COMPLETIONS, G, **kw)
    model.train()
    move(model)
    logps = gr.token_logps(model, PROMPTS, COMPLETIONS, G, **kw)
    mask = gr.completion_mask(completions, mask_truncated)
    s = gr.LossSettings(loss_type, 0.2, epsilon_high, beta, MAX_LEN)
    loss, stats = gr.token_losses(logps, old, ref if beta else None, adv, s)
    total = gr.aggregate(loss, mask, loss_type, gr.StepCounts(len(COMPLETIONS), int(mask.sum()), 1), MAX_LEN)
    total.backward()
    metrics.update({k: float((v * mask).sum() / mask.sum()) for k, v in stats.items()})
    return total.detach(), grads(model), dict(adv=adv, old=old, ref=ref, mask=mask), metrics


CASES = [("grpo", 0.0, "group", False), ("bnpo", 0.04, "batch", False), ("dr_grpo", 0.0, "none", True),
         ("dapo", 0.04, "group", True), ("dapo", 0.0, "group", False), ("grpo", 0.1, "none", True)]


@pytest.mark.parametrize("loss_type,beta,scale,mask_truncated", CASES)
def test_loss_gradients_and_metrics_equal_trl(tiny, loss_type, beta, scale, mask_truncated):
    theirs, their_grads, inputs, their_metrics = trl_run(tiny, loss_type, beta, scale, mask_truncated)
    ours, our_grads, mine, our_metrics = our_run(tiny, loss_type, beta, scale, mask_truncated)
    torch.testing.assert_close(mine["adv"], inputs["advantages"], atol=1e-6, rtol=1e-6)
    L = inputs["completion_ids"].size(1)
    torch.testing.assert_close(mine["mask"], inputs["completion_mask"].float()[:, :L])
    m = mine["mask"].bool()
    torch.testing.assert_close(mine["old"][m], inputs["old_per_token_logps"][m], atol=2e-5, rtol=1e-5)
    if beta:
        torch.testing.assert_close(mine["ref"][m], inputs["ref_per_token_logps"][m], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    assert our_grads.keys() == their_grads.keys()
    for name, g in their_grads.items():
        assert g.abs().max() > 0, name
        torch.testing.assert_close(our_grads[name], g, atol=1e-6, rtol=1e-4)
    shared = ["reward", "reward_std", "frac_reward_zero_std", "rewards/parity/mean", "rewards/parity/std",
              "rewards/brevity/mean", "rewards/brevity/std", "completions/mean_length", "completions/min_length",
              "completions/max_length", "completions/clipped_ratio", "completions/mean_terminated_length",
              "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", *(["kl"] if beta else [])]
    for k in shared:
        assert math.isclose(our_metrics[k], their_metrics[k], rel_tol=1e-5, abs_tol=1e-6), k
    assert their_metrics["clip_ratio/region_mean"] > 0  # the clip acted


def test_an_upper_clip_of_its_own_equals_trl(tiny):
    """--epsilon_high (DAPO's clip-higher) as TRL's epsilon_high."""
    theirs, their_grads, _, their_metrics = trl_run(tiny, "dapo", 0.0, "group", False, epsilon_high=0.05)
    ours, our_grads, _, our_metrics = our_run(tiny, "dapo", 0.0, "group", False, epsilon_high=0.05)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    for name, g in their_grads.items():
        torch.testing.assert_close(our_grads[name], g, atol=1e-6, rtol=1e-4)
    assert our_metrics["clip_ratio/high_mean"] == pytest.approx(their_metrics["clip_ratio/high_mean"])


@pytest.mark.parametrize("head", [False, True])
def test_log_probabilities_at_a_temperature_equal_the_full_logits(tiny, head):
    """token_logps (each prompt once, its completions continuing it; the output layer's chunked cross entropy, a
    frozen head's or a LoRA head's) equals log_softmax(logits / T) of each sequence on its own, values and LoRA
    gradients."""
    model = load_model(tiny.folder, precision="32-true", lora=lora_cfg(query=True, value=True, head=head), seed=0)
    randomize_lora(model, seed=5)
    ours = gr.token_logps(model, PROMPTS, COMPLETIONS, G, temperature=TEMPERATURE, lm_head_chunk=4, device="cpu")
    ours.sum().backward()
    our_grads = grads(model)
    want = torch.zeros_like(ours)
    for k, c in enumerate(COMPLETIONS):
        ids = torch.tensor(PROMPTS[k // G] + c)
        logp = (model(ids[None])[0] / TEMPERATURE).log_softmax(-1)
        n = len(PROMPTS[k // G])
        want[k, :len(c)] = logp[n - 1:n - 1 + len(c)].gather(-1, torch.tensor(c)[:, None])[:, 0]
    want.sum().backward()
    torch.testing.assert_close(ours, want, atol=2e-5, rtol=1e-5)
    for name, g in grads(model).items():
        torch.testing.assert_close(our_grads[name], g, atol=1e-5, rtol=1e-4)
