"""lm-evaluation-harness over our GPT: `LitLM`, an `lm_eval.api.model.LM` (through lm-eval's `TemplateLM`, which splits
context and continuation into ids exactly as its Hugging Face backend does), and `run_tasks`, which runs lm-eval's
tasks on it and writes the results where scripts/evaluate.py says.

lm-eval is an optional dependency (`pip install 'lit-qlora[eval]'`): it is imported only when this module is.
Scoring: every request's ids go through the model once, in batches of similar length padded on the right (causal
attention: a padded position never reaches an earlier one), and only the continuation's positions go through the
output layer. Generation (generate_until) runs every request together in the batched engine (lit_qlora.engine).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from lit_qlora.engine import Engine, Sampling
from lit_qlora.precision import autocast_for
from lit_qlora.tokenizer import Tokenizer
from lit_qlora.utils import UserError

try:
    from lm_eval.api.model import TemplateLM
except ImportError as e:  # pragma: no cover - the message is the point
    raise UserError("scripts/evaluate.py needs lm-eval (lm-evaluation-harness); install it with "
                    "`pip install 'lit-qlora[eval]'` or `pip install lm-eval`") from e


class LitLM(TemplateLM):
    """Our GPT (quantized or not, an adapter merged or kept separate) as an lm-eval model.

    model: a GPT in eval mode on `device`; tokenizer: the checkpoint's; precision: the resolved one (mixed precisions
    run under autocast); batch_size: sequences per forward pass when scoring; max_gen_toks: generate_until's default
    length when a task gives none.
    """

    def __init__(self, model, tokenizer: Tokenizer, device: torch.device, precision: str = "32-true",
                 batch_size: int = 8, max_gen_toks: int = 256) -> None:
        super().__init__()
        if batch_size < 1:
            raise UserError(f"--batch_size must be at least 1, got {batch_size}")
        self.model, self.tokenizer, self._device = model, tokenizer, device
        self.precision, self.batch_size, self.max_gen_toks = precision, batch_size, max_gen_toks

    # ---- what TemplateLM asks of a model ------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        eos = self.tokenizer.eos_id if self.tokenizer.eos_id is not None else next(iter(self.tokenizer.stop_ids), None)
        if eos is None:
            raise UserError(f"the tokenizer in {self.tokenizer.checkpoint_dir} has no eos token, which lm-eval needs "
                            "(the end of a text); add eos_token to its tokenizer_config.json")
        return eos

    @property
    def prefix_token_id(self) -> int:
        """The id an empty context is replaced by: bos where the tokenizer has one, else eos (as HFLM does)."""
        return self.tokenizer.bos_id if self.tokenizer.bos_id is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self.model.config.block_size

    def _token_text(self, i: int) -> str:
        p = self.tokenizer.processor
        return p.id_to_token(i) if self.tokenizer.backend == "huggingface" else p.id_to_piece(i)

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs) -> list[int]:
        """Ids of `string`; None: with the tokenizer's own special tokens (bos unless the text starts with it), as
        transformers' encode does by default; False: none."""
        special = add_special_tokens
        if special is None and string.startswith(self._token_text(self.prefix_token_id)):
            special = False
        flag = None if special in (None, True) else False
        return self.tokenizer.encode(string, bos=flag, eos=flag).tolist()

    def tok_decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    # ---- scoring ---------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: Optional[int] = None):
        """[(cache key or None, context ids, continuation ids)] -> [(sum of the continuation's log-probabilities,
        whether greedy decoding gives the continuation)], in request order."""
        out: list[Optional[tuple[float, bool]]] = [None] * len(requests)
        limit = self.max_length
        rows = []
        for i, (_, ctx, cont) in enumerate(requests):
            if not cont:
                raise UserError("lm-eval asked for the log-likelihood of an empty continuation; check the task's "
                                "doc_to_choice / doc_to_target")
            ids = (list(ctx) + list(cont))[-(limit + 1):][:-1]  # the last id is only a target
            rows.append((i, ids, list(cont)[-len(ids):] if len(cont) > len(ids) else list(cont)))
        rows.sort(key=lambda r: -len(r[1]))  # similar lengths share a batch: less padding
        size = override_bs or self.batch_size
        for start in range(0, len(rows), size):
            batch = rows[start:start + size]
            T = len(batch[0][1])
            idx = torch.zeros(len(batch), T, dtype=torch.long)
            mask = torch.zeros(len(batch), T, dtype=torch.bool)
            for b, (_, ids, cont) in enumerate(batch):
                idx[b, :len(ids)] = torch.tensor(ids)
                mask[b, len(ids) - len(cont):len(ids)] = True  # the positions that predict the continuation
            with autocast_for(self.precision, self._device):
                logits = self.model(idx.to(self._device), output_mask=mask.to(self._device))  # [N, V], row-major
            logp = F.log_softmax(logits.float(), dim=-1)
            offset = 0
            for i, _, cont in batch:
                lp = logp[offset:offset + len(cont)]
                offset += len(cont)
                target = torch.tensor(cont, device=lp.device)
                answer = (float(lp.gather(1, target[:, None]).sum()), bool((lp.argmax(-1) == target).all()))
                out[i] = answer
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's whole log-likelihood, in windows of the model's context (lm-eval's own windowing, each token
        predicted once, the first from the prefix token)."""
        from lm_eval import utils as lm_utils

        windows, owner = [], []
        for n, (text,) in enumerate(req.args for req in requests):
            for ctx, cont in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                    context_len=1)):
                windows.append((None, ctx, cont))
                owner.append(n)
        totals = [0.0] * len(requests)
        for n, (lp, _) in zip(owner, self._loglikelihood_tokens(windows)):
            totals[n] += lp
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ---- generation ------------------------------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each context continued (greedy unless the task asks to sample) until one of its `until` strings or an eos
        id, at most max_gen_toks tokens; the text before the first stop string. All of them as one continuous batch
        of the engine (a sampled one draws with seed 1234, whatever runs beside it)."""
        engine = Engine(self.model, tokenizer=self.tokenizer, precision=self.precision,
                        max_batch=max(self.batch_size, 16))
        stops = tuple(self.tokenizer.stop_ids)
        runs = []
        for req in requests:
            context, kwargs = req.args
            kwargs = dict(kwargs or {})
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            temperature = float(kwargs.pop("temperature", 0.0) or 0.0) if kwargs.pop("do_sample", False) else 0.0
            ids = self.tok_encode(context)[-max(1, self.max_length - max_new):]
            max_new = min(max_new, self.max_length - len(ids))
            sampling = Sampling(max_new_tokens=max_new, temperature=temperature, top_k=kwargs.get("top_k"),
                                top_p=kwargs.get("top_p"), seed=1234, stop_ids=stops,
                                stop_strings=tuple(s for s in until if s))
            runs.append((until, engine.submit(ids, sampling) if max_new > 0 else None))
        engine.run()
        results = []
        for req, (until, seq) in zip(requests, runs):
            text = self.tokenizer.decode([t for t in seq.new_ids if t not in stops]) if seq is not None else ""
            for stop in until:
                text = text.split(stop)[0] if stop else text
            self.cache_hook.add_partial("generate_until", req.args, text)
            results.append(text)
        return results


def run_tasks(lm: LitLM, tasks: list[str], include_path: Optional[Path] = None, num_fewshot: Optional[int] = None,
              limit: Optional[float] = None, log_samples: bool = False, out_dir: Optional[Path] = None,
              seed: int = 1234, model_name: str = "lit-qlora") -> dict:
    """Run lm-eval's `tasks` (names, or tasks in YAMLs under `include_path`) on `lm`; returns lm-eval's results
    dict. With `out_dir`: results.json and results.md (lm-eval's table) there, and with `log_samples` lm-eval's own
    per-sample files (samples_<task>_<date>.jsonl, through its EvaluationTracker) under out_dir/<model_name>/."""
    from lm_eval import simple_evaluate
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import handle_non_serializable, make_table

    if include_path is not None and not Path(include_path).is_dir():
        raise UserError(f"--include_path {include_path} is not a folder; give the folder that holds the task YAMLs")
    manager = None
    if include_path is not None:  # lm-eval's own 10,000+ task YAMLs take a while to index: only when needed
        manager = TaskManager(include_path=str(include_path), include_defaults=False)
        if not all(t in manager.all_tasks for t in tasks):
            manager = None
    if manager is None:
        manager = TaskManager(include_path=str(include_path) if include_path is not None else None)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise UserError(f"lm-eval knows no task {', '.join(unknown)}; `lm-eval ls tasks` lists them, and "
                        "--include_path adds a folder of task YAMLs")
    tracker = EvaluationTracker(output_path=str(out_dir)) if out_dir is not None else None
    results = simple_evaluate(model=lm, tasks=list(tasks), num_fewshot=num_fewshot, limit=limit,
                              log_samples=log_samples, evaluation_tracker=tracker, task_manager=manager,
                              random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
                              fewshot_random_seed=seed, batch_size=lm.batch_size)
    samples = results.pop("samples", None) if results is not None else None
    if out_dir is not None and results is not None:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "results.json").write_text(json.dumps(results, indent=2, default=handle_non_serializable,
                                                         ensure_ascii=False))
        table = make_table(results) + ("\n" + make_table(results, "groups") if results.get("groups") else "")
        (out_dir / "results.md").write_text(table)
        if log_samples and samples:
            tracker.general_config_tracker.model_name_sanitized = model_name  # the folder (lm-eval: from model_args)
            tracker.save_results_aggregated(results=dict(results), samples=samples)
            for task in results["configs"]:
                tracker.save_results_samples(task_name=task, samples=samples[task])
    if results is not None and samples is not None:
        results["samples"] = samples
    return results
