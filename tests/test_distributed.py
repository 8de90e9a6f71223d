"""Scaling out on CPU process groups (gloo): several machines (torchrun on localhost) and the sharded base (FSDP2).

What is shown here:
1. the sharded loader (lit_qlora.loader.load_model_sharded under torch's fully_shard) is the unsharded model split:
   every parameter is a DTensor split along dim 0 over all ranks, the 4-bit weights as packed bytes; gathered, the
   packed bytes, block scales, dense and LoRA weights are bit-identical to load_model's, and a training step gives the
   same logits and LoRA gradients; bf16-stored 4-bit bytes with NaN bit patterns survive the gathers (bitsandbytes#1945
   is a CUDA-path report); rank 0 holds exactly the bytes lit_qlora.memory predicts per rank, and each rank's resident
   memory grows by about half the base while loading (two ranks);
2. two "machines" (torchrun --nnodes 2, one process each, static rendezvous on localhost) train the same LoRA weights
   as one process over the same global batches, checkpoints are written once (by rank 0), and a two-machine run
   resumes from one of them (with --strategy fsdp: a DDP checkpoint continues sharded);
3. --strategy fsdp on two processes follows DDP's loss curve within 1e-4 (relative) over 10 steps and writes the same
   adapter file as ever, gathered from the shards.
Bad input (--num_nodes without a launcher, world sizes, what fsdp cannot shard) is in tests/test_reliability.py, the
per-rank estimate in tests/test_memory.py.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import helpers_distributed as hd
import helpers_train as h
import psutil
import pytest
import torch
import torch.multiprocessing as mp

from lit_qlora.adapter import Adapter
from lit_qlora.config import Config
from lit_qlora.data.records import split
from lit_qlora.train.training import list_checkpoints

# ---- 1. the sharded loader ---------------------------------------------------------------------------------------
MEDIUM = dict(name="medium", n_layer=20, n_head=8, n_embd=512, intermediate_size=1408, vocab_size=512, block_size=64)
TIED = dict(name="tied", n_layer=2, n_head=4, n_query_groups=1, n_embd=64, intermediate_size=128, vocab_size=320,
            block_size=64, tie_embeddings=True)
NEOX = dict(name="neox", hf_architecture="GPTNeoXForCausalLM", n_layer=2, n_head=4, n_embd=64, intermediate_size=256,
            vocab_size=320, block_size=64, norm_class="LayerNorm", bias=True, mlp_class="GptNeoxMLP",
            activation="gelu", parallel_residual=True, rotary_percentage=0.25)
ALL = dict(r=4, alpha=8, dropout=0.0, key=True, projection=True, mlp=True, head=True)


@pytest.fixture(scope="module")
def sharded_loads(tmp_path_factory):
    """Every rank's findings (sharded_load_worker) for four cases, from one spawn of two processes."""
    base = tmp_path_factory.mktemp("sharded")
    folders = {n: str(hd.random_checkpoint(base / n, Config(**c))) for n, c in (("medium", MEDIUM), ("tied", TIED),
                                                                               ("neox", NEOX))}
    cases = [  # the medium case last: its memory is measured once the code paths are warm (first calls map code)
        dict(name="tied nf4, quantized head, bf16 storage", folder=folders["tied"], quantize="bnb.nf4",
             precision="32-true", lora=ALL, quantize_lm_head=True, storage="bfloat16"),
        dict(name="tied fp4-dq, shared head", folder=folders["tied"], quantize="bnb.fp4-dq", precision="bf16-true",
             lora=dict(ALL, head=False), quantize_lm_head=False),
        dict(name="neox dense", folder=folders["neox"], quantize=None, precision="32-true", lora=ALL,
             quantize_lm_head=True),
        # LoRA variants that start from the whole weights: DoRA's magnitudes and row norms, PiSSA's / LoftQ's residual
        dict(name="dora + pissa, nf4-dq", folder=folders["neox"], quantize="bnb.nf4-dq", precision="32-true",
             lora=dict(ALL, head=False, dora=True, init="pissa"), quantize_lm_head=False),
        dict(name="dora + loftq + rslora, nf4", folder=folders["tied"], quantize="bnb.nf4", precision="32-true",
             lora=dict(ALL, head=False, dora=True, init="loftq", loftq_iters=2, rslora=True), quantize_lm_head=False),
        dict(name="dora + gaussian, dense bf16", folder=folders["neox"], quantize=None, precision="bf16-true",
             lora=dict(ALL, dora=True, init="gaussian"), quantize_lm_head=False),
        dict(name="medium nf4-dq bf16", folder=folders["medium"], quantize="bnb.nf4-dq", precision="bf16-true",
             lora=dict(r=8, alpha=16, dropout=0.0), quantize_lm_head=True, compare=False),
    ]
    out = base / "out"
    out.mkdir()
    mp.spawn(hd.sharded_load_worker, args=(2, hd.free_port(), cases, str(out)), nprocs=2)
    mp.spawn(hd.unsharded_load_worker, args=(cases[0], cases[-1], str(out / "unsharded.json")), nprocs=1)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    found = {case["name"]: (ranks[0][i], ranks[1][i]) for i, case in enumerate(cases)}
    found["unsharded medium"] = json.loads((out / "unsharded.json").read_text())
    return found


@pytest.mark.parametrize("case", ["tied nf4, quantized head, bf16 storage", "tied fp4-dq, shared head",
                                  "neox dense"])
def test_sharded_load_is_the_unsharded_model_split(sharded_loads, case):
    r0, r1 = sharded_loads[case]
    for r in (r0, r1):
        assert r["all_shard0"], {n: v for n, v in r["plan"].items() if v["placements"] != ["Shard(dim=0)"]}
        assert r["fourbit_have_state"]
        assert r["grads_finite"] and r["inf_seen_by_all"]  # an inf in rank 1's shard stops the step on both ranks
    for name, v in r0["plan"].items():  # the two shards make the whole, rank 0's is the larger (ceil) one
        rows = [r0["plan"][name]["local_shape"][0], r1["plan"][name]["local_shape"][0]]
        assert sum(rows) == v["shape"][0] and rows[0] == -(-v["shape"][0] // 2), (name, rows, v["shape"])
    storage = "torch.bfloat16" if "bf16 storage" in case else "torch.uint8"
    for layer in r0["fourbit_layers"]:  # 4-bit weights: packed bytes [n/2, 1], split along their bytes
        p = r0["plan"][layer + ".weight"]
        assert p["dtype"] == storage and p["shape"][1] == 1, (layer, p)
    assert bool(r0["fourbit_layers"]) == ("dense" not in case)
    if "shared head" in case:
        assert "lm_head" not in r0["fourbit_layers"] and "lm_head.weight" not in r0["plan"]  # wte itself, once
    # gathered == unsharded, bit for bit
    assert r0["param_diffs"] and all(d == 0 for d in r0["param_diffs"].values()), r0["param_diffs"]
    assert all(r0["quant_states_equal"].values()), r0["quant_states_equal"]
    if "bf16 storage" in case:
        assert r0["nan_patterns"] > 0, "the case must hold packed bytes that read as NaN in bf16"
    # one training step: the same logits, the same LoRA gradients (averaged over ranks of equal inputs)
    assert r0["logits_max_diff"] <= 1e-6 * r0["logits_scale"], (r0["logits_max_diff"], r0["logits_scale"])
    assert r0["grads"] and all("lora_" in n for n in r0["grads"]) and r0["grad_max_rel_diff"] <= 1e-5
    # what rank 0 holds is what the estimator predicts per rank, to the byte
    assert r0["rank_bytes"] == r0["estimated_rank_bytes"], (r0["rank_bytes"], r0["estimated_rank_bytes"])


@pytest.mark.parametrize("case", ["dora + pissa, nf4-dq", "dora + loftq + rslora, nf4", "dora + gaussian, dense bf16"])
def test_sharded_lora_variants_start_as_unsharded(sharded_loads, case):
    """DoRA, PiSSA, LoftQ and the gaussian init under FSDP: every LoRA tensor (A, B, the magnitudes) sharded like the
    rest, and gathered equal to load_model's: the residual bases, the initial A0 / B0 and DoRA's row norms (whole on
    every rank) bit for bit, the magnitudes within fp32 rounding of the product they start from; one training step
    gives the same logits and LoRA gradients (the magnitudes' included). Red with the residual not taken, the
    gaussian init drawn as kaiming, or the row norms of a shard."""
    r0, r1 = sharded_loads[case]
    assert r0["all_shard0"] and r1["all_shard0"] and r0["fourbit_have_state"]
    diffs = r0["param_diffs"]
    assert {n.rsplit(".", 1)[1] for n in diffs if "lora_" in n} >= (
        {"lora_A", "lora_B", "lora_magnitude", "lora_wnorm2"} | ({"lora_A0", "lora_B0"} if "gaussian" not in case
                                                                  else set()))
    assert all(d == 0 for n, d in diffs.items() if "lora_magnitude" not in n), {n: d for n, d in diffs.items() if d}
    assert all(0 <= d <= 1e-5 for n, d in diffs.items() if "lora_magnitude" in n), diffs
    assert all(r0["quant_states_equal"].values())
    assert r0["logits_max_diff"] <= 1e-5 * r0["logits_scale"], (r0["logits_max_diff"], r0["logits_scale"])
    assert any("lora_magnitude" in n for n in r0["grads"]) and r0["grad_max_rel_diff"] <= 1e-4


def test_each_rank_holds_about_half_the_base(sharded_loads):
    """The medium model: ~64M parameters, 33 MiB at nf4-dq (bf16 embeddings and norms). Loaded sharded over two
    ranks, each rank's resident memory grows by about half of that (its shards, the block scales every rank keeps
    whole, FSDP's bookkeeping), where the unsharded load (what every DDP rank does) grows by all of it; at the peak
    both add the same working memory of the quantizer (a few MiB on CPU, quant.quantize.CPU_QUANTIZE_CHUNK)."""
    r0, r1 = sharded_loads["medium nf4-dq bf16"]
    ref = sharded_loads["unsharded medium"]
    full, ref_growth, ref_peak = r0["full_bytes"], ref["rss_growth"], ref["rss_peak_growth"]
    assert ref_growth > 0.95 * full, (ref_growth, full)
    for r in (r0, r1):
        mine = r["rank_bytes"]
        print(f"rank {r['rank']}: base {full / 2**20:.1f} MiB, holds {mine / 2**20:.1f} MiB; RSS +"
              f"{r['rss_growth'] / 2**20:.1f} MiB after loading sharded, +{r['rss_peak_growth'] / 2**20:.1f} MiB at "
              f"the peak (unsharded: +{ref_growth / 2**20:.1f} / +{ref_peak / 2**20:.1f} MiB)")
        assert 0.5 * full <= mine <= 0.53 * full and r["all_shard0"], (mine, full)
        assert mine == r["estimated_rank_bytes"] or r["rank"] == 1, (mine, r["estimated_rank_bytes"])
        assert 0.4 * full < r["rss_growth"] < mine + 6 * 2**20, (r["rss_growth"], mine, full)
        # half the base less at the peak, minus a margin for the allocator (CI measured 0.38x full less)
        assert r["rss_peak_growth"] < ref_peak - 0.25 * full, (r["rss_peak_growth"], ref_peak, full)


# ---- 2. several machines -------------------------------------------------------------------------------------------
COMMON = dict(quantize="bnb.nf4-dq", precision="32-true", accelerator="cpu", learning_rate=1e-2, min_lr=1e-2,
              warmup_steps=0, lora_dropout=0.0, eval_interval=5, eval_iters=2, save_interval=5, keep_checkpoints=0,
              max_iters=10)  # min_lr == learning_rate: a constant rate, so a resumed run may extend --max_iters


def _outputs_of_killed(procs: list[subprocess.Popen], done: list[str]) -> str:
    """The tail of what each node printed to stderr (`done`: of the nodes that had finished, in order), after
    `_kill_all`: where a rendezvous or a collective was stuck."""
    parts = []
    for i, q in enumerate(procs):
        if i < len(done):
            err = done[i]
        else:
            try:
                err = q.communicate(timeout=10)[1]
            except subprocess.TimeoutExpired:
                err = "(not readable)"
        parts.append(f"--- node {i}, exit {q.returncode}, stderr tail:\n{(err or '')[-3000:]}")
    return "\n".join(parts)


def _kill_all(procs: list[subprocess.Popen]) -> None:
    for q in procs:
        try:
            for child in psutil.Process(q.pid).children(recursive=True):
                child.kill()
        except psutil.NoSuchProcess:  # this node had finished
            pass
        q.kill()


def run_nodes(setup: dict, out, nnodes: int = 2, check: bool = True, node_kw: tuple = (), pythonpath: str = "",
              **kw) -> list[subprocess.CompletedProcess]:
    """finetune/lora.py on `nnodes` localhost 'machines' through torchrun, one process each (`node_kw`: flags that
    differ per machine; `pythonpath`: a folder searched before the repository's)."""
    port = hd.free_port()
    flags = [{**COMMON, "devices": 1, "num_nodes": nnodes, "micro_batch_size": 2, **kw, **(node_kw[r] if node_kw
                                                                                             else {})}
             for r in range(nnodes)]
    args = [h.train_args(setup, f.pop("out_dir", out), **f) for f in flags]
    env = h.env()
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([pythonpath, env["PYTHONPATH"]])
    procs = [subprocess.Popen(hd.torchrun_node(r, nnodes, port, h.FINETUNE, args[r]), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env, cwd=h.ROOT)
             for r in range(nnodes)]
    results = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:  # e.g. processes out of step in a collective: end them all, workers too
            _kill_all(procs)  # (torchrun starts its workers in sessions of their own)
            raise AssertionError(f"the {nnodes} nodes (port {port}) did not finish in 240 s:\n"
                                 + _outputs_of_killed(procs, [r.stderr for r in results])) from None
        results.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    for i, r in enumerate(results):
        assert not check or r.returncode == 0, f"node {i} exit {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    return results


@pytest.fixture(scope="module")
def one_process(train_setup, tmp_path_factory):
    """The reference: one process, micro batch 4 = the global batch of the two-process runs."""
    out = tmp_path_factory.mktemp("one") / "out"
    h.train(train_setup, out, **{**COMMON, "devices": 1, "micro_batch_size": 4})
    return out


@pytest.fixture(scope="module")
def two_nodes(train_setup, tmp_path_factory):
    """DDP over two torchrun 'machines': 10 iterations, checkpoints at 5 and 10. Every worker would abort in its
    interpreter's teardown (a sitecustomize registers os.abort at exit), as gloo's teardown of the process group
    sometimes did ("terminate called without an active exception", then the other machine waited forever): a run
    must be over, every rank exited 0, before that teardown (distributed.end_all_ranks)."""
    site = tmp_path_factory.mktemp("abort_at_exit")
    (site / "sitecustomize.py").write_text("import atexit, os\n"
                                           "if 'LOCAL_RANK' in os.environ:  # torchrun's workers, not its agents\n"
                                           "    atexit.register(os.abort)\n")
    out = tmp_path_factory.mktemp("nodes") / "out"
    return out, run_nodes(train_setup, out, pythonpath=str(site))


def test_the_last_call_of_a_rank_exits_with_its_code_when_stdout_is_a_closed_pipe(monkeypatch):
    """`... | head` closes the pipe early: flushing stdout then raises, and a rank must still leave with its code."""
    from lit_qlora import distributed

    class ClosedPipe:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            raise BrokenPipeError(32, "Broken pipe")

    class Fabric:
        waited = False

        def barrier(self):
            Fabric.waited = True

    exits = []
    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    monkeypatch.setattr(distributed.os, "_exit", exits.append)
    distributed.end_all_ranks(Fabric(), 143)
    assert Fabric.waited and exits == [143]


def test_two_machines_equal_one_process(one_process, two_nodes):
    out, (node0, node1) = two_nodes
    assert h.max_abs_diff(h.load_lora(one_process / "lit_model_lora_finetuned.pth"),
                          h.load_lora(out / "lit_model_lora_finetuned.pth")) < 1e-5
    l1, l2 = h.losses_by_iter(one_process), h.losses_by_iter(out)
    assert sorted(l1) == sorted(l2) == list(range(1, 11)) and all(abs(l1[i] - l2[i]) < 1e-5 for i in l1), (l1, l2)
    # checkpoints written once, by global rank 0 (node 0); every node's rank checked the weights agree
    assert [p.name for p in list_checkpoints(out)] == ["iter-000005.pth", "iter-000010.pth"]
    assert node0.stderr.count("Saved checkpoint") == 2 and "Saved checkpoint" not in node1.stderr
    assert "Saved the adapter" in node0.stderr and "Saved the adapter" not in node1.stderr
    assert "ranks agree: max diff 0" in node0.stderr
    assert not list(out.rglob("*.tmp"))
    summary = json.loads((out / "metrics.json").read_text())
    assert (summary["devices"], summary["num_nodes"], summary["strategy"]) == (2, 2, "ddp")


def test_two_machines_resume_sharded(train_setup, one_process, two_nodes, tmp_path):
    """Continue the two-machine DDP run from its iteration-5 checkpoint, now with --strategy fsdp: both machines
    resume at 5 and the run ends where the uninterrupted one did. The same training samples, but one validation
    sample: the second machine's share of it is empty, and under FSDP it must still take part in every forward."""
    a, _ = two_nodes
    b = tmp_path / "resumed"
    (b / "checkpoints").mkdir(parents=True)
    shutil.copy(a / "checkpoints/iter-000005.pth", b / "checkpoints/iter-000005.pth")
    shutil.copy(a / "metrics.csv", b / "metrics.csv")
    train, val = split(h.make_records(), 0.05, 42)  # what the runs on tasks.json train and validate on
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.json").write_text(json.dumps(train))
    (data / "val.json").write_text(json.dumps(val[:1]))
    node0, node1 = run_nodes(dict(train_setup, data=data), b, resume="true", strategy="fsdp")
    for r in (node0, node1):
        assert f"Resuming from {b / 'checkpoints/iter-000005.pth'} at iteration 5" in r.stderr, r.stderr
    la, lb = h.losses_by_iter(a), h.losses_by_iter(b)
    assert sorted(lb) == list(range(1, 11)) and all(abs(la[i] - lb[i]) <= 1e-4 * abs(la[i]) for i in la), (la, lb)
    for ref in (a, one_process):
        assert h.max_abs_diff(h.load_lora(ref / "lit_model_lora_finetuned.pth"),
                              h.load_lora(b / "lit_model_lora_finetuned.pth")) < 1e-5


def test_machines_that_found_different_checkpoints_refuse_to_start(train_setup, two_nodes, tmp_path):
    """No shared storage: machine 0 finds a checkpoint at iteration 5 in its --out_dir, machine 1 none in its own.
    Both stop with one line before loading anything, instead of training out of step (which hangs). Launched by
    hand this time, Fabric's own way: the same command on each machine with NODE_RANK and MASTER_ADDR set."""
    a, _ = two_nodes
    (tmp_path / "m0/checkpoints").mkdir(parents=True)
    shutil.copy(a / "checkpoints/iter-000005.pth", tmp_path / "m0/checkpoints/iter-000005.pth")
    port = hd.free_port()
    procs = [subprocess.Popen([str(x) for x in [sys.executable, h.FINETUNE, *h.train_args(
        train_setup, tmp_path / f"m{r}", **{**COMMON, "devices": 1, "num_nodes": 2, "micro_batch_size": 2,
                                           "resume": "auto"})]], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env={**h.env(), "NODE_RANK": str(r), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
        cwd=h.ROOT) for r in range(2)]
    seen: list[str] = []
    for p in procs:
        try:
            _, stderr = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            _kill_all(procs)
            raise AssertionError(f"the 2 nodes (port {port}) did not stop in 120 s:\n"
                                 + _outputs_of_killed(procs, seen)) from None
        seen.append(stderr)
        lines = [ln for ln in stderr.splitlines() if ln.startswith("error: ")]
        assert p.returncode == 2 and lines == [
            "error: the processes of this run would start at different iterations (0 to 5): each machine found "
            "another checkpoint in --out_dir; put --out_dir on storage every machine sees, or pass the same --resume "
            "path everywhere"], stderr
        assert "Loaded" not in stderr and "Traceback" not in stderr
    assert not (tmp_path / "m1/checkpoints").exists()


# ---- 3. the sharded base, two processes on one machine -------------------------------------------------------------
def test_fsdp_follows_ddp(train_setup, one_process, two_nodes, tmp_path):
    ddp, _ = two_nodes
    out = tmp_path / "fsdp"
    r = h.train(train_setup, out, **{**COMMON, "devices": 2, "micro_batch_size": 2, "strategy": "fsdp"})
    assert "this rank holds" in r.stderr and "ranks agree" not in r.stderr
    l_ddp, l_fsdp = h.losses_by_iter(ddp), h.losses_by_iter(out)
    assert sorted(l_fsdp) == list(range(1, 11))
    assert all(abs(l_fsdp[i] - l_ddp[i]) <= 1e-4 * abs(l_ddp[i]) for i in l_ddp), (l_ddp, l_fsdp)
    assert h.max_abs_diff(h.load_lora(one_process / "lit_model_lora_finetuned.pth"),
                          h.load_lora(out / "lit_model_lora_finetuned.pth")) < 1e-5
    # the same self-describing adapter file as without sharding, gathered from the shards
    adapter = Adapter.load(out / "lit_model_lora_finetuned.pth",
                           Config.from_file(train_setup["ckpt"] / "model_config.json"))
    single = Adapter.load(one_process / "lit_model_lora_finetuned.pth")
    assert adapter.lora.keys() == single.lora.keys() and adapter.train == single.train
    assert all(v.shape == single.lora[k].shape and not hasattr(v, "device_mesh") for k, v in adapter.lora.items())
    ckpt = torch.load(out / "checkpoints/iter-000010.pth", map_location="cpu", weights_only=False)
    assert set(ckpt["resume"]["optimizer"]["state"]) == set(adapter.lora)  # whole AdamW state, by parameter name
    summary = json.loads((out / "metrics.json").read_text())
    assert summary["strategy"] == "fsdp" and [x["rank"] for x in summary["ranks"]] == [0, 1]
    full = summary["quantized_bytes"] + summary["dense_bytes"]
    assert all(x["weight_bytes"] < 0.6 * full for x in summary["ranks"]), (summary["ranks"], full)
