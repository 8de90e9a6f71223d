#!/usr/bin/env bash
# Fine-tune + generate for every model x setting, then build the comparison table (scripts/report.py).
#
#   scripts/run_matrix.sh                                   # the demo model over the default settings
#   MODELS="checkpoints/meta-llama/Llama-2-7b-hf" DATA_DIR=data/alpaca MAX_ITERS=500 scripts/run_matrix.sh
#
# Every list is an environment variable (space-separated):
#   MODELS            checkpoint folders (default: the demo model, built if missing)
#   SETTINGS          precision:quantize:optimizer:micro_batch_size[:ckpt] tuples; quantize "none" for dense,
#                     a 5th field "ckpt" turns on activation checkpointing (default: see below)
#   DATA_DIR          data for finetune/lora.py --data_dir (default: the demo data)
#   OUT_ROOT          results go to OUT_ROOT/<model name>/<setting>/ (default: out/matrix)
#   MAX_ITERS         training iterations per cell (default: 100)
#   EXTRA_TRAIN_ARGS  more arguments for finetune/lora.py, e.g. "--lora_mlp true --eval_iters 10"
#   EXTRA_GEN_ARGS    more arguments for generate/lora.py, e.g. "--max_new_tokens 50"
#   PROMPT            the generation prompt (default: the demo's prompt for the demo model, else an Alpaca one)
#   PYTHON            the interpreter (default: python)
#   SKIP_FAILED=1     also skip cells that failed before (by default only finished cells are skipped)
#
# Each cell writes its logs (train_stdout.log, train_stderr.log, generate_*.log), finetune's metrics.json and
# metrics.csv, generate_metrics.json and status.json: {"status": "ok" | "failed" | "oom", "exit_code", "error",
# "stage"}. A failed or out-of-memory cell is recorded and the matrix goes on. Running the script again skips the
# cells whose status is ok and continues an interrupted training from its last checkpoint (--resume auto).
set -u

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1  # the repository root

PYTHON=${PYTHON:-python}
OUT_ROOT=${OUT_ROOT:-out/matrix}
MAX_ITERS=${MAX_ITERS:-100}
EXTRA_TRAIN_ARGS=${EXTRA_TRAIN_ARGS:-}
EXTRA_GEN_ARGS=${EXTRA_GEN_ARGS:-}
SKIP_FAILED=${SKIP_FAILED:-0}
SETTINGS=${SETTINGS:-"bf16-true:none:AdamW:4 bf16-true:bnb.nf4:AdamW:4 bf16-true:bnb.nf4-dq:AdamW:4 bf16-true:bnb.nf4-dq:PagedAdamW8bit:4 bf16-true:bnb.int8:AdamW:4 bf16-true:bnb.nf4-dq:AdamW:4:ckpt"}

if [ -z "${MODELS:-}" ]; then
    MODELS=checkpoints/lit-qlora/demo
    DATA_DIR=${DATA_DIR:-data/demo}
    "$PYTHON" -c "from lit_qlora import demo; demo.ensure_demo_checkpoint(); demo.ensure_demo_data()" || exit 1
    PROMPT=${PROMPT:-$("$PYTHON" -c "from lit_qlora import demo; print(' '.join(demo.DEMO_PROMPT))")}
fi
PROMPT=${PROMPT:-"Give three tips for staying healthy."}
if [ -z "${DATA_DIR:-}" ]; then
    echo "error: DATA_DIR is not set; set it to the data folder for finetune/lora.py --data_dir" >&2
    exit 2
fi

# write_status FILE STATUS EXIT_CODE ERROR STAGE: status.json via Python, so any error text is valid JSON
write_status() {
    "$PYTHON" - "$@" <<'EOF'
import json, sys
path, status, code, error, stage = sys.argv[1:6]
with open(path, "w") as f:
    json.dump({"status": status, "exit_code": int(code), "error": error, "stage": stage}, f, indent=2)
EOF
}

# status_of FILE: the "status" field of a status.json, or "none"
status_of() {
    [ -f "$1" ] || { echo none; return; }
    "$PYTHON" -c 'import json, sys; print(json.load(open(sys.argv[1])).get("status", "none"))' "$1" 2>/dev/null || echo none
}

# classify EXIT_CODE STDERR_LOG: "oom" for the kernel's OOM kill (137) or an out-of-memory error, else "failed"
classify() {
    if [ "$1" -eq 137 ] || grep -qiE "out of memory|MemoryError|OutOfMemoryError|Cannot allocate memory" "$2" 2>/dev/null; then
        echo oom
    else
        echo failed
    fi
}

# last_error STDERR_LOG: the last non-empty line of a log (the "error: ..." line or the exception)
last_error() {
    grep -v '^[[:space:]]*$' "$1" 2>/dev/null | tail -n 1
}

n_ok=0; n_failed=0; n_skipped=0; order=0
for model in $MODELS; do
    model_name=$(basename "$model")
    for setting in $SETTINGS; do
        order=$((order + 1))
        IFS=: read -r precision quantize optimizer mbs ckpt <<< "$setting"
        slug="${precision}_${quantize}_${optimizer}_mb${mbs}${ckpt:+_$ckpt}"
        cell="$OUT_ROOT/$model_name/$slug"
        status=$(status_of "$cell/status.json")
        if [ "$status" = ok ] || { [ "$SKIP_FAILED" = 1 ] && [ "$status" != none ] && [ "$status" != running ]; }; then
            echo "[skip] $model_name $slug ($status)"
            n_skipped=$((n_skipped + 1))
            continue
        fi
        mkdir -p "$cell"
        printf '{"model": "%s", "checkpoint_dir": "%s", "setting": "%s", "order": %d}\n' \
            "$model_name" "$model" "$setting" "$order" > "$cell/cell.json"
        write_status "$cell/status.json" running 0 "" train

        # 1. train (skipped when a previous run of this cell finished training but not generation)
        if [ ! -f "$cell/metrics.json" ] || [ ! -f "$cell/lit_model_lora_finetuned.pth" ]; then
            echo "[train] $model_name $slug"
            ac=false; [ "$ckpt" = ckpt ] && ac=true
            # shellcheck disable=SC2086  # EXTRA_TRAIN_ARGS is a list of arguments
            "$PYTHON" finetune/lora.py --checkpoint_dir "$model" --data_dir "$DATA_DIR" --out_dir "$cell" \
                --precision "$precision" --quantize "$quantize" --optimizer "$optimizer" --micro_batch_size "$mbs" \
                --activation_checkpointing "$ac" --max_iters "$MAX_ITERS" --resume auto $EXTRA_TRAIN_ARGS \
                > "$cell/train_stdout.log" 2> "$cell/train_stderr.log"
            code=$?
            if [ $code -ne 0 ] || [ ! -f "$cell/metrics.json" ]; then
                kind=$(classify $code "$cell/train_stderr.log")
                write_status "$cell/status.json" "$kind" $code "$(last_error "$cell/train_stderr.log")" train
                echo "[$kind] $model_name $slug: training exited with $code"
                n_failed=$((n_failed + 1))
                continue
            fi
        fi

        # 2. generate with the adapter, same quantization and precision
        echo "[generate] $model_name $slug"
        quant_args=()
        [ "$quantize" != none ] && quant_args=(--quantize "$quantize")
        # shellcheck disable=SC2086  # EXTRA_GEN_ARGS is a list of arguments
        "$PYTHON" generate/lora.py --checkpoint_dir "$model" --lora_path "$cell/lit_model_lora_finetuned.pth" \
            --precision "$precision" ${quant_args[@]+"${quant_args[@]}"} --prompt "$PROMPT" \
            --metrics_file "$cell/generate_metrics.json" $EXTRA_GEN_ARGS \
            > "$cell/generate_stdout.log" 2> "$cell/generate_stderr.log"
        code=$?
        if [ $code -ne 0 ]; then
            kind=$(classify $code "$cell/generate_stderr.log")
            write_status "$cell/status.json" "$kind" $code "$(last_error "$cell/generate_stderr.log")" generate
            echo "[$kind] $model_name $slug: generation exited with $code"
            n_failed=$((n_failed + 1))
            continue
        fi
        write_status "$cell/status.json" ok 0 "" done
        n_ok=$((n_ok + 1))
    done
done

echo "Cells: $n_ok done now, $n_skipped skipped (done before), $n_failed failed"
"$PYTHON" scripts/report.py "$OUT_ROOT"
