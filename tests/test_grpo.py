"""lit_qlora/train/grpo.py against TRL 1.16's own GRPOTrainer code: on the same prompts, completions, reward functions
and weights, TRL's `_generate_and_score_completions` (its sampler stubbed to return the given completions) and
`_compute_loss` run on a bare trainer object holding the settings they read; the model they call is our GPT (its full
logits, divided by the temperature, through the interface of TRL's fused head), so both sides differentiate the same
LoRA weights. Equal: the advantages, the sampling policy's and the reference's log-probabilities, the loss, the LoRA
gradients and the metrics, for every loss type, with and without beta, with num_iterations 2 and the adapter moved
between sampling and update (so the clip acts)."""
from __future__ import annotations

import json
import math
from collections import defaultdict, deque
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch
from helpers import converted_tiny, lora_cfg, lora_grads, randomize_lora

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
        state=SimpleNamespace(num_input_tokens_seen=0, global_step=0),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
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
    return loss.detach(), lora_grads(model), inputs, {k: v[-1] for k, v in t._metrics["train"].items()}


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
    return total.detach(), lora_grads(model), dict(adv=adv, old=old, ref=ref, mask=mask), metrics


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
    our_grads = lora_grads(model)
    want = torch.zeros_like(ours)
    for k, c in enumerate(COMPLETIONS):
        ids = torch.tensor(PROMPTS[k // G] + c)
        logp = (model(ids[None])[0] / TEMPERATURE).log_softmax(-1)
        n = len(PROMPTS[k // G])
        want[k, :len(c)] = logp[n - 1:n - 1 + len(c)].gather(-1, torch.tensor(c)[:, None])[:, 0]
    want.sum().backward()
    torch.testing.assert_close(ours, want, atol=2e-5, rtol=1e-5)
    for name, g in lora_grads(model).items():
        torch.testing.assert_close(our_grads[name], g, atol=1e-5, rtol=1e-4)


# ---- finetune/grpo.py end to end ---------------------------------------------------------------------------------



@pytest.fixture(scope="module")
def prompt_setup(tmp_path_factory):
    """The tiny Llama and its tokenizer (helpers_train), a folder of prompt rows with an answer column, and a reward
    file: `low` (the share of a completion's tokens below 160, which the tiny model can learn to raise) and bad
    functions for the error tests."""
    import helpers_train as h

    setup = h.tiny_setup(tmp_path_factory)
    base = tmp_path_factory.mktemp("grpo")
    rows = [{"prompt": f"kind {r['input']}", "answer": r["output"], "level": i % 3}
            for i, r in enumerate(h.make_records(48, seed=1))]
    data = base / "prompts"
    data.mkdir()
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rewards = base / "my_rewards.py"
    rewards.write_text(REWARD_FILE)
    return {**setup, "prompts": data, "rewards": rewards}


REWARD_FILE = '''
import json
import math

def low(completion_ids, **kwargs):
    return [sum(t < 160 for t in ids) / len(ids) for ids in completion_ids]

def raises(completions, level, **kwargs):
    return [1 / (lv - lv) for lv in level]

def short(completions, **kwargs):
    return [0.0] * (len(completions) - 1)

def words(completions, **kwargs):
    return ["good"] * len(completions)

def nan(completions, **kwargs):
    return [math.nan] * len(completions)

CALLS = [0]

def late(completions, **kwargs):
    CALLS[0] += 1
    if CALLS[0] > 2:
        raise ValueError("no answer here")
    return [0.5] * len(completions)
'''


def grpo_args(s: dict, out, max_iters: int = 10, **kw) -> list[str]:
    import helpers_train as h

    opts = dict(data_dir=s["prompts"], reward=f"{s['rewards']}:low", num_generations=8, max_completion_length=6,
                micro_batch_size=2, batch_size=4, learning_rate=3e-2, eval_iters=0, quantize="bnb.nf4",
                lora_mlp="true", lora_head="true", lora_r=8, lora_alpha=16, warmup_steps=0, seed=3)
    opts.update(kw)
    return h.train_args(s, out, max_iters, **opts)


def run_grpo(args: list, check: bool = True):
    import helpers_train as h

    r = h.run_script(h.ROOT / "finetune" / "grpo.py", args, timeout=600)
    if check:
        assert r.returncode == 0, r.stderr[-3000:]
    return r


def rewards_by_iter(out) -> list[float]:
    import helpers_train as h

    return [float(r["reward"]) for r in h.read_metrics(out) if r.get("reward")]


def test_a_few_steps_raise_the_mean_reward(prompt_setup, tmp_path):
    """Ten steps of GRPO on a reward the tiny random model can learn (more of its tokens below id 160; its output
    layer adapted, as the random model's logits are nearly flat) raise the mean sampled reward clearly above where it
    started (red when the advantages' sign is flipped)."""
    out = tmp_path / "out"
    run_grpo(grpo_args(prompt_setup, out))
    r = rewards_by_iter(out)
    assert len(r) == 10
    first, last = sum(r[:2]) / 2, sum(r[-2:]) / 2
    assert last > first + 0.1, r


def run_grpo_here(args: list):
    """finetune/grpo.py in this process (argument parsing, run_main's one-line errors): (returncode, stderr)."""
    import helpers_train as h
    from helpers import run_in_process

    return run_in_process(h.ROOT / "finetune" / "grpo.py", *args)


def assert_stops_in_one_line(r, *expect: str) -> None:
    """A run that stopped mid-way: exit 2, no traceback, its last line the one-line error."""
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and all(e in last for e in expect), last


@pytest.mark.parametrize("fn,expect", [
    ("raises", ["reward function raises raised ZeroDivisionError", "(on row ", "train.jsonl)"]),
    ("short", ["reward function short returned 7 rewards for 8 completions (rows row "]),
    ("words", ["reward function words returned 'good' (str) for a completion of row ", "not a number"]),
    ("nan", ["reward function nan returned nan for a completion of row ", "finite number"])])
def test_a_bad_reward_function_stops_in_one_line_naming_it_and_the_row(prompt_setup, tmp_path, fn, expect):
    r = run_grpo_here(grpo_args(prompt_setup, tmp_path / "out", 2, reward=f"{prompt_setup['rewards']}:{fn}",
                                batch_size=2, num_generations=4, micro_batch_size=1))
    assert_stops_in_one_line(r, *expect)


def test_a_reward_failing_mid_run_keeps_the_last_checkpoint(prompt_setup, tmp_path):
    """The third call raises: the run stops in one line at iteration 3, the checkpoint of iteration 2 intact (it
    resumes)."""
    from lit_qlora.train.training import find_resume

    out = tmp_path / "out"
    r = run_grpo_here(grpo_args(prompt_setup, out, 4, reward=f"{prompt_setup['rewards']}:late", save_interval=1,
                                keep_checkpoints=0, batch_size=2, micro_batch_size=1, num_generations=4))
    assert_stops_in_one_line(r, "reward function late raised ValueError: no answer here (on row ")
    path, state = find_resume(out, "true")
    assert path.name == "iter-000002.pth" and state["resume"]["step"] == 2


def test_resuming_retraces_the_run_with_its_kept_samples(prompt_setup, tmp_path):
    """With --num_iterations 2 a checkpoint after an odd step holds the samples its next step updates on again:
    resumed there, the run continues exactly (same losses, rewards and adapter) as without the stop."""
    import shutil

    import helpers_train as h

    kw = dict(num_iterations=2, beta=0.05, save_interval=3, keep_checkpoints=0, lora_head="false")
    whole, part = tmp_path / "whole", tmp_path / "part"
    run_grpo(grpo_args(prompt_setup, whole, 6, **kw))
    shutil.copytree(whole, part)
    for f in ("metrics.json", "lit_model_lora_finetuned.pth"):
        (part / f).unlink()
    for ckpt in (part / "checkpoints").glob("iter-00000[4-6].pth"):
        ckpt.unlink()
    run_grpo(grpo_args(prompt_setup, part, 6, resume="true", **kw))
    a, b = h.read_metrics(whole), h.read_metrics(part)
    assert [r["iter"] for r in a] == [r["iter"] for r in b] == [str(i) for i in range(1, 7)]
    for x, y in zip(a[3:], b[3:]):
        for k in ("loss", "reward", "kl", "clip_ratio/region_mean"):
            assert float(x[k]) == pytest.approx(float(y[k]), abs=1e-6), (x["iter"], k)
    assert float(a[3]["clip_ratio/region_mean"]) + float(a[5]["clip_ratio/region_mean"]) > 0  # updates 2 of a batch
    final = "lit_model_lora_finetuned.pth"
    assert h.max_abs_diff(h.load_lora(whole / final), h.load_lora(part / final)) < 1e-6


@pytest.mark.parametrize("flags,expect", [
    (dict(num_generations=1), "--num_generations 1: GRPO compares the completions"),
    (dict(loss_type="ppo"), "unknown --loss_type 'ppo'; choose one of grpo, bnpo, dr_grpo, dapo"),
    (dict(micro_batch_size="auto"), "finetune/grpo.py does not take --micro_batch_size auto"),
    (dict(strategy="fsdp"), "finetune/grpo.py does not take --strategy fsdp"),
    (dict(reward="nowhere.py:f"), "--reward nowhere.py:f: no such file nowhere.py"),
    (dict(reward="exact_answer", answer_column="solution"), "has no 'solution' column, which the exact_answer"),
    (dict(reward_weights="[1, 2]"), "--reward_weights has 2 value(s) for 1 --reward function(s)"),
    (dict(temperature=0), "--temperature must be above 0")])
def test_bad_flags_are_one_line_errors(prompt_setup, tmp_path, flags, expect):
    import helpers_train as h

    r = run_grpo_here(grpo_args(prompt_setup, tmp_path / "out", 2, **flags))
    h.assert_one_line_error(r, expect)


def all_rows(out) -> list[dict]:
    import csv

    with open(out / "metrics.csv") as f:
        return list(csv.DictReader(f))


def test_two_devices_train_as_one(prompt_setup, tmp_path):
    """DDP on two CPU processes, each prompt's group sampled, scored and updated on one of them (one prompt each per
    micro batch), the rewards of both gathered for the metrics: the same samples (seeded per prompt and completion),
    rewards, losses and adapter as one process doing both micro batches, and a validation reward over both devices'
    prompts."""
    import helpers_train as h

    kw = dict(beta=0.05, eval_iters=2, eval_interval=2, accelerator="cpu", lora_head="false")
    one, two = tmp_path / "one", tmp_path / "two"
    run_grpo(grpo_args(prompt_setup, one, 3, micro_batch_size=2, batch_size=4, **kw))
    run_grpo(grpo_args(prompt_setup, two, 3, micro_batch_size=1, batch_size=4, devices=2, **kw))
    a, b = all_rows(one), all_rows(two)
    assert [r["iter"] for r in a] == [r["iter"] for r in b] == ["0", "1", "2", "3"]
    for x, y in zip(a, b):
        for k in ("loss", "reward", "reward_std", "kl", "completions/mean_length", "val_reward"):
            if x[k] or y[k]:
                assert float(x[k]) == pytest.approx(float(y[k]), abs=2e-5), (x["iter"], k)
    final = "lit_model_lora_finetuned.pth"
    # (Adam's first steps normalize each gradient entry: a 1e-8 difference in a near-zero one moves it by up to lr)
    assert h.max_abs_diff(h.load_lora(one / final), h.load_lora(two / final)) < 2e-4
    assert json.loads((two / "metrics.json").read_text())["devices"] == 2


# ---- reward functions -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text,answer", [
    ("so it is \\boxed{\\frac{3}{4}} then 5", "\\frac{3}{4}"), ("<think>7?</think><answer> 42 </answer> 9", "42"),
    ("6 + 8 = 14.", "14"), ("about 1,250 people", "1,250"), (" yppah", "yppah"), ("", None)])
def test_the_answer_of_a_completion(text, answer):
    from lit_qlora.train.rewards import extract_answer

    assert extract_answer(text) == answer


@pytest.mark.parametrize("completion,gold,right", [
    ("6 + 8 = 14", "14", True), ("it is 13", "14", False), ("#### 1250", "1,250", True), ("0.50", "1/2", True),
    ("<answer>Paris</answer>", "paris", True), (" koob", "book", False),
    ("\\boxed{14}", "The answer: \\boxed{14}", True)])
def test_the_exact_answer_reward(completion, gold, right):
    """Built-in exact_answer against a column: numbers as numbers, words as words (never as products of symbols)."""
    from lit_qlora.train.rewards import exact_answer_reward

    fn = exact_answer_reward("answer")
    assert fn(completions=[completion, [{"role": "assistant", "content": completion}]], answer=[gold, gold]) == [
        float(right)] * 2


def test_math_verify_when_installed():
    pytest.importorskip("math_verify")
    from lit_qlora.train.rewards import answers_match

    assert answers_match("\\frac{1}{2}", "0.5") and answers_match("x+1", "1+x") and not answers_match("2", "3")


def test_format_and_length_rewards_and_loading(tmp_path):
    from lit_qlora.train.rewards import load_rewards
    from lit_qlora.utils import UserError

    (tmp_path / "mine.py").write_text("def score(completions, **kw):\n    return [1.0] * len(completions)\n")
    rewards = load_rewards(["format", "length", f"{tmp_path / 'mine.py'}:score", "json:dumps"], [1, 0.5, 2, 1],
                           answer_column="answer", format_regex=None, max_completion_length=8)
    assert [(r.name, r.weight) for r in rewards] == [("format", 1.0), ("length", 0.5), ("score", 2.0), ("dumps", 1.0)]
    good, bad = "<think>a b</think>\n<answer>3</answer>", "<answer>3</answer>"
    assert rewards[0].fn(completions=[good, bad]) == [1.0, 0.0]
    assert rewards[1].fn(completion_ids=[[1, 2], [1] * 8]) == [-0.25, -1.0]
    for spec, expect in [("nothing", "neither a built-in"), ("mine.py:f", "no such file"),
                         (f"{tmp_path / 'mine.py'}:absent", "has no 'absent'"),
                         ("no_such_module_x:f", "cannot import")]:
        with pytest.raises(UserError, match=expect):
            load_rewards([spec], None, answer_column="a", format_regex=None, max_completion_length=8)
    with pytest.raises(UserError, match="two functions are named 'format'"):
        load_rewards(["format", "format"], None, answer_column="a", format_regex=None, max_completion_length=8)


def test_sampling_through_the_4bit_kernel_follows_the_adapter_as_it_trains(tiny):
    """The completions finetune/grpo.py samples (one batch of the engine, through the 4-bit decoding kernel with the
    unmerged adapter folded into each call) are those of the plain 4-bit model decoding each completion alone
    (generation.generate, bitsandbytes' path, a generator of the completion's seed), and after an in-place update of
    the adapter (an optimizer step) those of the updated adapter: no stale decoding copy of A and B is used."""
    from lit_qlora.generation import generate
    from lit_qlora.quant.decode4bit import kernel

    if kernel() is None:
        pytest.skip("no C compiler for the decoding kernel")
    model = load_model(tiny.folder, precision="32-true", quantize="bnb.nf4", lora=lora_cfg(query=True, value=True,
                                                                                           mlp=True), seed=0)
    randomize_lora(model, seed=2)
    prompts = [p for p in PROMPTS for _ in range(G)]
    sampling = [gr.Sampling(6, 1.0, seed=gr.completion_seed(1, 0, i // G, i % G)) for i in range(len(prompts))]

    def both() -> tuple[list, list]:
        model.eval()
        with torch.no_grad():
            plain = [generate(model, torch.tensor(p), 6, temperature=1.0,
                              generator=torch.Generator().manual_seed(s.seed))[len(p):].tolist()
                     for p, s in zip(prompts, sampling)]
        model.train()
        batched = [c.ids for c in gr.sample_completions(model, prompts, sampling)]
        assert model.training
        return plain, batched

    before, batched_before = both()
    assert batched_before == before
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_B.mul_(-3.0)  # in place, as an optimizer step updates it
    after, batched_after = both()
    assert batched_after == after and after != before


def test_starting_from_an_sft_adapter_it_is_the_reference(prompt_setup, tmp_path):
    """--lora_path: the run trains that adapter further (its LoRA settings, not the flags'), and with --beta the
    reference is that adapter as it was: the first step's KL is 0 (the base would be far from it)."""
    import helpers_train as h
    from helpers import random_adapter

    from lit_qlora.adapter import Adapter

    sft = tmp_path / "sft.pth"
    random_adapter(prompt_setup["ckpt"], seed=4, query=True, value=True, mlp=True).save(sft)
    out = tmp_path / "out"
    run_grpo(grpo_args(prompt_setup, out, 2, lora_path=sft, beta=0.5, lora_r=2, lora_head="false"))
    rows = h.read_metrics(out)
    assert float(rows[0]["kl"]) == 0.0 and float(rows[1]["kl"]) > 0
    trained = Adapter.load(out / "lit_model_lora_finetuned.pth")
    assert trained.config == Adapter.load(sft).config and trained.config.r == 4
    assert h.max_abs_diff(trained.lora, Adapter.load(sft).lora) > 0


def test_rewards_repeat_on_the_command_line_and_list_in_a_config(tmp_path):
    """--reward / --reward_weights given several times make lists in order (TRL's reward_funcs, reward_weights); a
    --config file lists them as YAML lists; the GRPO help says what the shared batch flags count."""
    from lit_qlora.args import finetune_parser, parse_finetune_args

    a = parse_finetune_args(["--checkpoint_dir", str(tmp_path), "--reward", "f.py:one", "--reward=exact_answer",
                             "--reward_weights", "1", "--reward_weights", "0.5"], grpo=True)
    assert (a.grpo.reward, a.grpo.reward_weights, a.data.prompt_column) == (["f.py:one", "exact_answer"], [1.0, 0.5],
                                                                            "prompt")
    (tmp_path / "c.yaml").write_text(f"checkpoint_dir: {tmp_path}\nreward: [format, length]\nreward_weights: [2, 1]\n")
    a = parse_finetune_args(["--config", str(tmp_path / "c.yaml")], grpo=True)
    assert (a.grpo.reward, a.grpo.reward_weights) == (["format", "length"], [2.0, 1.0])
    text = " ".join(finetune_parser(grpo=True).format_help().split())
    assert "Prompts per forward/backward per device, each with its --num_generations completions" in text


def test_conversation_prompts_render_as_transformers_does(tmp_path):
    """A `prompt` of messages, and a `messages` row whose last turn is an answer, are prompted as transformers'
    apply_chat_template(..., add_generation_prompt=True) renders them (the answer left out); the other columns are
    kept for the rewards; a text prompt goes in as it is."""
    import transformers
    from helpers_chat import load_template, make_chat_checkpoint

    from lit_qlora.data.prepare import DataSettings
    from lit_qlora.tokenizer import Tokenizer

    folder = make_chat_checkpoint("chatml_smollm", tmp_path / "smol", load_template("smollm2_instruct"))
    tok, hf = Tokenizer(folder), transformers.AutoTokenizer.from_pretrained(folder)
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Add 2 and 3"}]
    rows = [{"prompt": turns, "answer": "5"}, {"messages": [*turns, {"role": "assistant", "content": "5"}], "n": 1},
            {"prompt": "2 + 3 =", "answer": "5"}]
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (data / "val.jsonl").write_text(json.dumps(rows[0]) + "\n")
    train, val, meta = gr.load_prompts(data, tok, DataSettings(256), "prompt", 256)
    want = hf.apply_chat_template(turns, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert train[0].ids == train[1].ids == val[0].ids == list(want)
    assert train[0].prompt == turns and train[0].columns == {"answer": "5"} and train[1].columns == {"n": 1}
    assert train[2].ids == tok.encode("2 + 3 =").tolist() and train[2].prompt == "2 + 3 ="
    assert [p.index for p in (*train, *val)] == [0, 1, 2, 3]
