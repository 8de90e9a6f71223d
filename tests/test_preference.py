"""lit_qlora/train/preference.py against TRL's own trainer code: for each --loss, the loss and the LoRA gradients equal
what TRL's DPOTrainer (dpo: loss_type sigmoid, ipo), CPOTrainer (simpo, cpo_alpha 0) and ORPOTrainer (orpo) compute
on the same batch of the same tiny model, in fp32. TRL's methods run unbound on a bare trainer object holding the
settings they read; the model they call is our GPT (its full logits), so both sides differentiate the same weights.
The reference log-probabilities equal transformers' base model (no adapter) through TRL's get_batch_logps."""
from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from helpers import converted_tiny, hf_model, lora_cfg, lora_grads, randomize_lora

from lit_qlora.loader import load_model
from lit_qlora.lora import lora_modules
from lit_qlora.quant.quant_mode import QuantMode
from lit_qlora.train import preference as pf

trl = pytest.importorskip("trl")
from trl.experimental.cpo import CPOTrainer  # noqa: E402
from trl.experimental.orpo import ORPOTrainer  # noqa: E402
from trl.trainer.dpo_trainer import DPOTrainer  # noqa: E402
from trl.trainer.utils import FusedCausalLMOutput, selective_log_softmax  # noqa: E402

BETA, GAMMA = 0.3, 0.7


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return converted_tiny(tmp_path_factory, "llama", "pref-llama")


@pytest.fixture(scope="module", params=["frozen_head", "head_lora"])
def policy(tiny, request):
    """The frozen dense head (the default: per-position log-probabilities made in forward, no logits kept,
    losses.head_cross_entropy) and a head with a LoRA (its logits kept for backward)."""
    targets = dict(query=True, key=True, value=True, projection=True, mlp=True, head=request.param == "head_lora")
    model = load_model(tiny.folder, precision="32-true", lora=lora_cfg(**targets), seed=0)
    randomize_lora(model, seed=3)  # policy != base
    return model.train()


def quantized_layers(model) -> list:
    import bitsandbytes as bnb

    return [m for m in model.modules() if isinstance(m, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))]


def make_pairs(seed: int = 0, n: int = 3) -> list[dict]:
    """Pairs of varied prompt and completion lengths (so padding and the per-token averages matter)."""
    g = torch.Generator().manual_seed(seed)
    pairs = []
    for i in range(n):
        prompt = torch.randint(0, 320, (3 + 2 * i,), generator=g)
        out = {"index": i}
        for side, n_new in (("chosen", 4 + i), ("rejected", 7 - i)):
            ids = torch.cat([prompt, torch.randint(0, 320, (n_new,), generator=g)])
            labels = ids.clone()
            labels[:len(prompt)] = -100
            out[f"{side}_ids"], out[f"{side}_labels"] = ids, labels
        pairs.append(out)
    return pairs


def ours(model, loss: str, batch: dict, ref: tuple) -> tuple[torch.Tensor, dict]:
    lp = pf.batch_logps(model, batch)
    per_pair, rc, rr = pf.pair_losses(loss, lp, *ref, beta=BETA, gamma=GAMMA)
    total = per_pair.mean()
    if loss == "orpo":
        total = total + pf.orpo_nll(lp) / lp.chosen_tokens.sum()
    total.backward()
    stats = {k: float(v) / len(rc) for k, v in pf.reward_stats(rc, rr).items()}
    return total.detach(), stats


class Accelerator:
    device = torch.device("cpu")

    @staticmethod
    def gather(t):
        return t

    gather_for_metrics = gather

    @staticmethod
    def unwrap_model(m):
        return m


def bare(cls, **attrs):
    t = cls.__new__(cls)  # no __init__: only the settings TRL's loss code reads
    t.__dict__.update(accelerator=Accelerator(), aux_loss_enabled=False, is_encoder_decoder=False, **attrs)
    return t


def trl_dpo(model, loss_type: str, batch: dict, ref: tuple) -> tuple[torch.Tensor, dict]:
    """DPOTrainer._compute_loss with reference log-probabilities given (precompute_ref_logps); the model is called
    as TRL calls a model patched by add_fused_lm_head: per-token log-probs of the labels (0 where -100)."""
    def fused(input_ids, attention_mask, use_cache, labels, fused_lm_head):
        logits = model(input_ids)[:, :-1]
        lab = labels[:, 1:]
        mask = lab != -100
        lp = selective_log_softmax(logits, lab.clamp(min=0)) * mask
        with torch.no_grad():
            entropy = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1) * mask
            mean_logits, is_top1 = logits.mean(-1) * mask, (logits.argmax(-1) == lab) & mask
        return FusedCausalLMOutput(log_probs=lp, entropy=entropy, mean_logits=mean_logits, is_top1=is_top1)

    trainer = bare(DPOTrainer, model=SimpleNamespace(training=True), ld_alpha=None, precompute_ref_logps=True,
                   f_divergence_type="reverse_kl", loss_types=[loss_type], loss_weights=[1.0], beta=BETA,
                   use_weighting=False, label_smoothing=0.0, _metrics={"train": defaultdict(list),
                                                                       "eval": defaultdict(list)},
                   _total_train_tokens=0, _tp_size=1)
    completion = (batch["labels"] != -100).long()
    real = torch.arange(batch["input_ids"].size(1))[None] < batch["lengths"][:, None]
    inputs = dict(input_ids=batch["input_ids"], attention_mask=real.long(), completion_mask=completion,
                  ref_chosen_logps=ref[0], ref_rejected_logps=ref[1])
    loss = DPOTrainer._compute_loss(trainer, fused, inputs, False)
    loss.backward()
    return loss.detach(), {k: v[-1] for k, v in trainer._metrics["train"].items() if k.startswith("rewards/")}


def trl_pairs_batch(pairs: list[dict]) -> dict:
    """CPO/ORPO's tokenized batch: chosen_/rejected_ input_ids, labels (prompt -100) and attention mask. ORPO's NLL
    takes its labels from the attention mask (prompt and completion); the completion mask is given there, so TRL's
    NLL counts the completion tokens only, as ours does (see lit_qlora/train/preference.py)."""
    out = {}
    for side in ("chosen", "rejected"):
        T = max(len(p[f"{side}_ids"]) for p in pairs)
        ids = torch.zeros(len(pairs), T, dtype=torch.long)
        labels = torch.full((len(pairs), T), -100)
        for i, p in enumerate(pairs):
            n = len(p[f"{side}_ids"])
            ids[i, :n], labels[i, :n] = p[f"{side}_ids"], p[f"{side}_labels"]
        out.update({f"{side}_input_ids": ids, f"{side}_labels": labels,
                    f"{side}_attention_mask": (labels != -100).long()})
    return out


def trl_cpo_orpo(model, loss: str, pairs: list[dict]) -> tuple[torch.Tensor, dict]:
    def forward(input_ids, attention_mask, use_cache):
        return SimpleNamespace(logits=model(input_ids))

    if loss == "simpo":
        trainer = bare(CPOTrainer, pad_token_id=0, cpo_alpha=0.0, loss_type="simpo", beta=BETA, simpo_gamma=GAMMA,
                       label_smoothing=0.0, alpha=0.0)
        loss_value, metrics = CPOTrainer.get_batch_loss_metrics(trainer, forward, trl_pairs_batch(pairs))
    else:
        trainer = bare(ORPOTrainer, padding_value=0, beta=BETA)
        loss_value, metrics = ORPOTrainer.get_batch_loss_metrics(trainer, forward, trl_pairs_batch(pairs))
    loss_value.backward()
    return loss_value.detach(), {k: v for k, v in metrics.items() if k.startswith("rewards/")}


@pytest.mark.parametrize("loss", pf.LOSSES)
def test_loss_and_gradients_equal_trl(policy, loss):
    pairs = make_pairs()
    batch = pf.collate_pairs(pairs)
    ref = (torch.tensor([-40.0, -35.5, -52.0]), torch.tensor([-44.0, -30.0, -41.0]))  # reference log-probs
    mine, my_stats = ours(policy, loss, batch, ref)
    my_grads = lora_grads(policy)
    if loss in ("dpo", "ipo"):
        theirs, their_stats = trl_dpo(policy, {"dpo": "sigmoid", "ipo": "ipo"}[loss], batch, ref)
    else:
        theirs, their_stats = trl_cpo_orpo(policy, loss, pairs)
    their_grads = lora_grads(policy)
    assert abs(float(mine) - float(theirs)) <= 1e-5, (float(mine), float(theirs))
    assert set(my_stats) == set(their_stats) == {"rewards/chosen", "rewards/rejected", "rewards/margins",
                                                 "rewards/accuracies"}
    for k in my_stats:
        assert abs(my_stats[k] - their_stats[k]) <= 1e-5, (k, my_stats[k], their_stats[k])
    assert max(float(g.abs().max()) for g in my_grads.values()) > 1e-4  # the gradients are not all zero
    for k in my_grads:
        torch.testing.assert_close(my_grads[k], their_grads[k], atol=1e-5, rtol=1e-4, msg=k)


@pytest.mark.parametrize("quantize", QuantMode.names())
def test_every_quantize_mode_reference_is_the_base_and_losses_equal_trl(tiny, quantize):
    """On each --quantize base: a fresh adapter's log-probabilities (what finetune/dpo.py keeps as the reference) are
    those of the same quantized base with no LoRA layers at all, so the first DPO loss is ln 2; once the policy
    moves, the DPO loss, rewards and LoRA gradients on the quantized model equal TRL's DPOTrainer loss code on it
    (fp32), and every LoRA weight gets a gradient through the quantized layers."""
    targets = dict(query=True, key=True, value=True, projection=True, mlp=True)
    pairs = make_pairs(seed=2)
    batch = pf.collate_pairs(pairs)
    base = load_model(tiny.folder, precision="32-true", quantize=quantize, seed=0).eval()
    policy = load_model(tiny.folder, precision="32-true", quantize=quantize, lora=lora_cfg(**targets), seed=0)
    assert len(quantized_layers(base)) == len(quantized_layers(policy)) > 0
    with torch.no_grad():
        want = pf.batch_logps(base, batch, share=False)  # the base alone, whole rows
        got = pf.batch_logps(policy.eval(), batch)
    torch.testing.assert_close(got.chosen, want.chosen, atol=1e-5, rtol=0)
    torch.testing.assert_close(got.rejected, want.rejected, atol=1e-5, rtol=0)
    first, _, _ = pf.pair_losses("dpo", got, want.chosen, want.rejected, beta=BETA)
    assert abs(float(first.mean()) - math.log(2)) < 1e-6
    randomize_lora(policy, seed=3)
    policy.train()
    ref = (want.chosen, want.rejected)
    mine, my_stats = ours(policy, "dpo", batch, ref)
    my_grads = lora_grads(policy)
    theirs, their_stats = trl_dpo(policy, "sigmoid", batch, ref)
    their_grads = lora_grads(policy)
    assert abs(float(mine) - float(theirs)) <= 1e-5, (float(mine), float(theirs))
    for k in my_stats:
        assert abs(my_stats[k] - their_stats[k]) <= 1e-5, (k, my_stats[k], their_stats[k])
    assert len(my_grads) == 2 * len(lora_modules(policy))
    for k in my_grads:
        assert float(my_grads[k].abs().max()) > 0, k  # a gradient reaches every LoRA weight
        torch.testing.assert_close(my_grads[k], their_grads[k], atol=1e-5, rtol=1e-4, msg=k)


def sharing_pairs(vocab: int = 320, seed: int = 4) -> list[dict]:
    """Pairs whose shared beginnings differ in kind: a prompt of one token (nothing to share), answers that begin
    with the same two tokens (shared past the prompt), a chosen answer that is the start of the rejected one."""
    g = torch.Generator().manual_seed(seed)
    pairs = []
    for i, (n_prompt, n_c, n_r) in enumerate([(5, 4, 6), (1, 3, 2), (7, 5, 5), (3, 2, 4)]):
        prompt = torch.randint(0, vocab, (n_prompt,), generator=g)
        c, r = torch.randint(0, vocab, (n_c,), generator=g), torch.randint(0, vocab, (n_r,), generator=g)
        if i == 2:
            r[:2] = c[:2]
        if i == 3:
            r[:2] = c
        pair = {"index": i}
        for side, answer in (("chosen", c), ("rejected", r)):
            ids = torch.cat([prompt, answer])
            labels = ids.clone()
            labels[:n_prompt] = -100
            pair[f"{side}_ids"], pair[f"{side}_labels"] = ids, labels
        pairs.append(pair)
    return pairs


def shared_vs_separate(model, pairs: list[dict]) -> None:
    """batch_logps with each pair's common beginning computed once equals the rows computed whole: the sequences'
    log-probabilities and token counts, and the trainable weights' gradients of a weighted sum of them."""
    batch = pf.collate_pairs(pairs)
    weights = torch.randn(2, len(pairs), generator=torch.Generator().manual_seed(0))
    out = {}
    for share in (True, False):
        model.zero_grad()
        lp = pf.batch_logps(model, batch, share=share)
        ((lp.chosen * weights[0]).sum() + (lp.rejected * weights[1]).sum()).backward()
        out[share] = (lp, {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    (a, ga), (b, gb) = out[True], out[False]
    for k in ("chosen", "rejected"):
        torch.testing.assert_close(getattr(a, k), getattr(b, k), atol=1e-5, rtol=1e-6)
        assert torch.equal(getattr(a, k + "_tokens"), getattr(b, k + "_tokens"))
    assert max(float(g.abs().max()) for g in gb.values()) > 1e-4
    for n in gb:
        torch.testing.assert_close(ga[n], gb[n], atol=1e-5, rtol=1e-4, msg=n)
    # what was shared: the prompt but its last token (2 pairs), plus the two common answer tokens (pair 2), plus the
    # chosen answer inside the rejected one (pair 3); the one-token prompt shares nothing
    flat, _, _ = pf.share_prefixes(batch)
    assert flat["input_ids"].size(1) == int(batch["lengths"].sum()) - (4 + 0 + 8 + 4)


def test_shared_prompts_equal_separate_rows(policy):
    """The training forward (chosen and rejected after one copy of their prompt) against the rows computed whole,
    on the tiny Llama with LoRA (frozen head and head LoRA)."""
    shared_vs_separate(policy, sharing_pairs())


@pytest.mark.parametrize("kind", ["window", "softcap"])
def test_shared_prompts_under_masks(kind):
    """The same where attention takes a mask: a sliding window shorter than the pairs (one [T, T] mask for the row,
    packed_attention_mask with the prefixes) and Gemma 2's soft-capped attention (its own kernel, the branch's mask)."""
    from lit_qlora.config import Config
    from lit_qlora.lora import apply_lora
    from lit_qlora.model import GPT

    config = Config(name="t", block_size=64, vocab_size=320, n_layer=2, n_head=4, n_embd=32, n_query_groups=2,
                    intermediate_size=48, mlp_class="LLaMAMLP", norm_class="RMSNorm", bias=False,
                    rotary_percentage=1.0, parallel_residual=False,
                    sliding_window_size=5 if kind == "window" else None,
                    attn_softcap=2.0 if kind == "softcap" else None)
    torch.manual_seed(0)
    model = GPT(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    apply_lora(model, lora_cfg(query=True, value=True, mlp=True))
    randomize_lora(model, seed=1)
    for n, p in model.named_parameters():
        p.requires_grad_("lora_" in n)
    shared_vs_separate(model.train(), sharing_pairs())


def test_reference_logps_equal_the_base_model(tiny):
    """A fresh adapter (B = 0), as training starts: its log-probabilities are transformers' base model's, through
    TRL's get_batch_logps; and so the first DPO loss is ln 2."""
    model = load_model(tiny.folder, precision="32-true", lora=lora_cfg(), seed=0).eval()
    pairs = make_pairs(seed=1)
    batch = pf.collate_pairs(pairs)
    with torch.no_grad():
        lp = pf.batch_logps(model, batch)
        hf = hf_model(tiny.folder)
        tb = trl_pairs_batch(pairs)
        want = {side: CPOTrainer.get_batch_logps(hf(tb[f"{side}_input_ids"]).logits, tb[f"{side}_labels"].clone())
                for side in ("chosen", "rejected")}
    torch.testing.assert_close(lp.chosen, want["chosen"], atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(lp.rejected, want["rejected"], atol=1e-4, rtol=1e-5)
    per_pair, rc, rr = pf.pair_losses("dpo", lp, lp.chosen, lp.rejected, beta=0.1)
    assert abs(float(per_pair.mean()) - math.log(2)) < 1e-6
    assert float(rc.abs().max()) == float(rr.abs().max()) == 0.0


# ---- data ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chat_tok(tmp_path_factory):
    from helpers_chat import load_template, make_chat_checkpoint

    from lit_qlora.tokenizer import Tokenizer

    folder = make_chat_checkpoint("chatml_smollm", tmp_path_factory.mktemp("tok") / "smol",
                                  load_template("smollm2_instruct"))
    return Tokenizer(folder)


def write_rows(folder, rows, name="train.jsonl"):
    import json

    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def settings(n: int = 256, **kw):
    from lit_qlora.data.prepare import DataSettings

    return DataSettings(n, template=kw.pop("template", "auto"), test_split_fraction=kw.pop("split", 0.25), **kw)


CONV = {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"},
                   {"role": "assistant", "content": "hi?"}, {"role": "user", "content": "again"}],
        "chosen": [{"role": "assistant", "content": "hi there"}],
        "rejected": [{"role": "assistant", "content": "no"}]}


def test_conversation_pairs_are_rendered_as_transformers_does(chat_tok, tmp_path):
    """ids = transformers' apply_chat_template(prompt + answer); the labels are the answer's turn only (the prompt,
    its earlier assistant turn included, is masked; the end-of-turn token is trained as in SFT); a row without a
    prompt (two full conversations) gives the same pair."""
    import transformers

    implicit = {"chosen": CONV["prompt"] + CONV["chosen"], "rejected": CONV["prompt"] + CONV["rejected"]}
    train, val, meta = pf.load_pairs(write_rows(tmp_path / "d", [CONV, implicit, CONV, implicit]), chat_tok,
                                     settings(split=0.0))
    assert meta["template"] == "chat" and len(train) == 4 and not val
    hf = transformers.AutoTokenizer.from_pretrained(chat_tok.checkpoint_dir)
    prompt_ids = hf.apply_chat_template(CONV["prompt"], add_generation_prompt=True, tokenize=True,
                                        return_dict=False)
    for side in ("chosen", "rejected"):
        want = hf.apply_chat_template(CONV["prompt"] + CONV[side], tokenize=True, return_dict=False)
        for p in train:
            ids, labels = p[f"{side}_ids"].tolist(), p[f"{side}_labels"].tolist()
            assert ids == want
            trained = [t for t, lab in zip(ids, labels) if lab != -100]
            answer = hf.encode(CONV[side][0]["content"] + "<|im_end|>", add_special_tokens=False)
            assert trained == answer, (hf.decode(trained), side)
            assert all(lab == -100 for lab in labels[:len(prompt_ids)])


@pytest.mark.parametrize("layout", ["implicit", "ultrafeedback"])
@pytest.mark.parametrize("store", ["parquet", "datasets_folder"])
def test_pairs_read_where_hub_datasets_keep_them(chat_tok, tmp_path, store, layout):
    """Rows as preference sets on the hub store them, in a .parquet file or a `datasets` save_to_disk folder, other
    columns beside them: chosen and rejected full conversations sharing their leading turns (TRL's implicit-prompt
    conversational format, Anthropic HH's conversions), or with a prompt field too that they repeat
    (UltraFeedback-binarized: prompt string, chosen / rejected = [user turn, assistant turn]). The same pairs as
    the rows {prompt, chosen, rejected} in JSONL."""
    pytest.importorskip("pyarrow")
    implicit = {"chosen": CONV["prompt"] + CONV["chosen"], "rejected": CONV["prompt"] + CONV["rejected"]}
    rows = [{**implicit, "score_chosen": 8.0, "score_rejected": 3.5, "prompt_id": str(i)} for i in range(4)]
    if layout == "ultrafeedback":
        implicit = {"prompt": CONV["prompt"][-1]["content"], "chosen": CONV["prompt"][-1:] + CONV["chosen"],
                    "rejected": CONV["prompt"][-1:] + CONV["rejected"]}
        rows = [{**implicit, "messages": implicit["chosen"], "score_chosen": 8.0, "prompt_id": str(i)}
                for i in range(4)]
        want_rows = [{"prompt": CONV["prompt"][-1:], "chosen": CONV["chosen"], "rejected": CONV["rejected"]}] * 4
    else:
        want_rows = [CONV] * 4
    want, _, _ = pf.load_pairs(write_rows(tmp_path / "jsonl", want_rows), chat_tok, settings(split=0.0))
    folder = tmp_path / store
    if store == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        folder.mkdir()
        pq.write_table(pa.Table.from_pylist(rows), folder / "train_prefs-00000-of-00001.parquet")
    else:
        datasets = pytest.importorskip("datasets")
        datasets.Dataset.from_list(rows).save_to_disk(str(folder))
    got, _, _ = pf.load_pairs(folder, chat_tok, settings(split=0.0))
    assert len(got) == len(want) == 4
    for a, b in zip(got, want):
        for k in ("chosen_ids", "chosen_labels", "rejected_ids", "rejected_labels"):
            assert torch.equal(a[k], b[k]), k


def test_string_pairs_mask_the_prompt(tmp_path):
    from helpers_tokenizer import make_hf_bpe_tokenizer

    from lit_qlora.data.templates import get_template
    from lit_qlora.tokenizer import Tokenizer

    tok = Tokenizer(make_hf_bpe_tokenizer(tmp_path / "tok", vocab_size=320))
    rows = [{"prompt": f"name a color {i}", "chosen": " red", "rejected": " cat"} for i in range(8)]
    train, val, _ = pf.load_pairs(write_rows(tmp_path / "d", rows, "pairs.json"), tok, settings(template="alpaca"))
    assert len(train) == 6 and len(val) == 2 and [p["index"] for p in train] == list(range(6))
    p = train[0]
    text = get_template("alpaca").format(rows[0]["prompt"])
    n_prompt = len(tok.encode(text))
    for side in ("chosen", "rejected"):
        ids, labels = p[f"{side}_ids"], p[f"{side}_labels"]
        assert (labels[:n_prompt] == -100).all() and (labels[n_prompt:] == ids[n_prompt:]).all()
        assert int(ids[-1]) == tok.eos_id


@pytest.mark.parametrize("row,expect", [
    ({"prompt": "p", "chosen": "a"}, "row 2 of {f} has no 'rejected' field"),
    ({"prompt": "p", "chosen": "a", "rejected": "a"}, "row 2 of {f}: chosen and rejected are the same"),
    ({"prompt": "p", "chosen": "word " * 80 + "yes", "rejected": "word " * 80 + "no"},
     "row 2 of {f}: chosen and rejected are the same 64 tokens within --max_seq_length 64"),  # cut: the same tokens
    ({"prompt": "p " * 300, "chosen": "a", "rejected": "b"}, "row 2 of {f}: the prompt is"),
    ({"prompt": "p", "chosen": "", "rejected": "b"}, "row 2 of {f} has an empty 'chosen' field"),
    ({"prompt": "p", "chosen": 0, "rejected": "b"}, "row 2 of {f}: 'chosen' is a number (0), not text"),  # not 'empty'
    ({"prompt": 7.5, "chosen": "a", "rejected": "b"}, "row 2 of {f}: 'prompt' is a number (7.5), not text"),
    ({"prompt": "p", "chosen": [{"role": "robot", "content": "a"}], "rejected": "b"}, "row 2 of {f}: turn 2"),
])
def test_bad_rows_are_one_line_errors(chat_tok, tmp_path, row, expect):
    from lit_qlora.utils import UserError

    good = {"prompt": "p", "chosen": "a", "rejected": "b"}
    folder = write_rows(tmp_path / "d", [good, row, good])
    with pytest.raises(UserError) as e:
        pf.load_pairs(folder, chat_tok, settings(64, template="chat"))
    msg = str(e.value)
    assert "\n" not in msg and expect.format(f=folder / "train.jsonl") in msg, msg
