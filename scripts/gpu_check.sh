#!/usr/bin/env bash
# GPU checks on a CUDA machine (torch, transformers installed; flash-attn, network and the model hub
# not needed). Run from anywhere:  bash scripts/gpu_check.sh      (stage limits add up to 6.5 minutes)
#
# 1. the torch backend's own GPU checks (scripts/gpu_check.py) and the GPU-marked tests;
# 2. a random-weight model of Llama-3.1-8B's shape, bf16, drawn directly on the GPU (timing needs no
#    trained weights; servetwin_random_weights.json marks the config-only directory);
# 3. `servetwin calibrate --device cuda` on it -> $OUT/calibration_<gpu>_llama-3.1-8b.yaml;
# 4. `servetwin compare` offline and online (Poisson) with that calibration, and the shipped preset's
#    prediction of the same runs (servetwin run, sim only) for the uncalibrated-vs-calibrated view.
# Results under $OUT (default ./gpu_check_out): one folder per stage, summary.txt, versions.txt.
# Each stage has its own timeout, so a slow stage cannot eat the next one's time; a failed stage is
# recorded and the script goes on. CPU dry run of the pipeline with a tiny shape:
#   GPU_CHECK_DEVICE=cpu GPU_CHECK_SMALL=1 bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
# the repo root is the package `servetwin` (package-dir mapping): import it through a link named so
PKG_ROOT="${TMPDIR:-/tmp}/servetwin_pkg_$$"
mkdir -p "$PKG_ROOT" && ln -sfn "$PWD" "$PKG_ROOT/servetwin"
export PYTHONPATH="$PKG_ROOT${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export SERVETWIN_CACHE="${SERVETWIN_CACHE:-${TMPDIR:-/tmp}/servetwin_cache}"
export OUT="${OUT:-$PWD/gpu_check_out}"
DEV="${GPU_CHECK_DEVICE:-cuda}"
SMALL="${GPU_CHECK_SMALL:-0}"
mkdir -p "$OUT"
T0=$(date +%s)
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] && PY=.venv/bin/python
ST=("$PY" -m servetwin.experiments.cli)
summary() { echo "$*" | tee -a "$OUT/summary.txt"; }
stage() {  # stage NAME TIMEOUT_S CMD...: run with a timeout, log to $OUT/NAME.log, record the status
  local name=$1 limit=$2; shift 2
  local t=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  summary "$(printf '%-16s rc=%-3s %4ss  (limit %ss)' "$name" "$rc" "$(( $(date +%s) - t ))" "$limit")"
  return $rc
}
: > "$OUT/summary.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,power.limit --format=csv \
  > "$OUT/nvidia_smi.txt" 2>&1 || true
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'available', torch.cuda.is_available(), 'transformers', transformers.__version__); \
print('device', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu')" | tee "$OUT/versions.txt"
git rev-parse HEAD >> "$OUT/versions.txt" 2>/dev/null || true

# -- 1. backend checks and GPU tests ------------------------------------------------------------
if [ "$SMALL" = "1" ]; then
  stage backend_checks 75 env GPU_CHECK_DEVICE="$DEV" GPU_CHECK_SMALL=1 "$PY" scripts/gpu_check.py
else
  stage backend_checks 75 "$PY" scripts/gpu_check.py
  stage gpu_tests 45 "$PY" -m pytest tests/gpu -q -x -p no:cacheprovider
fi

# -- 2. the random-weight model directory (config only; weights drawn on the device at load) -----
MODEL_DIR="$OUT/model_llama-3.1-8b-random"
mkdir -p "$MODEL_DIR"
"$PY" - "$MODEL_DIR" "$SMALL" <<'EOF'
import json, sys
from pathlib import Path
out, small = Path(sys.argv[1]), sys.argv[2] == "1"
# Llama-3.1-8B's published config.json (architecture only); SMALL: the same family, tiny
cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
       "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
       "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 131072,
       "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False, "attention_bias": False,
       "mlp_bias": False, "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16",
       "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 8192}}
if small:
    cfg.update(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=64, vocab_size=2048, max_position_embeddings=4096,
               bos_token_id=1, eos_token_id=2)
    cfg["rope_scaling"]["original_max_position_embeddings"] = 1024
(out / "config.json").write_text(json.dumps(cfg, indent=1))
(out / "servetwin_random_weights.json").write_text(json.dumps({"seed": 0}))
EOF
GPU_NAME=$("$PY" -c "import torch; print(torch.cuda.get_device_name(0).split()[-1].lower() if torch.cuda.is_available() else 'cpu')" 2>/dev/null || echo gpu)
CAL="$OUT/calibration_${GPU_NAME}_llama-3.1-8b.yaml"

# -- 3. calibrate the torch backend ---------------------------------------------------------------
DESIGN=default; [ "$SMALL" = "1" ] && DESIGN=quick
stage calibrate 120 "${ST[@]}" calibrate --model "$MODEL_DIR" --device "$DEV" --dtype bfloat16 --design "$DESIGN" \
  --threads 4 -o "$CAL" --trace-dir "$OUT/calibrate_trace"

# -- 4. offline and online comparisons ----------------------------------------------------------------
NBLOCKS=8192; [ "$SMALL" = "1" ] && NBLOCKS=1024
for kind in offline online; do
  if [ "$kind" = offline ]; then ARRIVAL="{type: offline}"; N=64; else ARRIVAL="{type: poisson, rate: 6.0}"; N=64; fi
  [ "$SMALL" = "1" ] && N=12
  cat > "$OUT/compare_$kind.yaml" <<EOF
name: gpu_check_$kind
seed: 7
model: $MODEL_DIR
hardware: $CAL
backends: [sim, torch]
engine: {max_num_seqs: 64, max_num_batched_tokens: 2048, enable_chunked_prefill: true, enable_prefix_caching: true,
         block_size: 16, num_gpu_blocks: $NBLOCKS, max_model_len: 4096, device: $DEV, dtype: bfloat16}
workload:
  requests: $N
  arrival: $ARRIVAL
  prompt_tokens: {type: uniform, low: 64, high: 1536}
  output_tokens: {type: uniform, low: 16, high: 160}
EOF
  if [ -f "$CAL" ]; then
    stage "compare_$kind" 50 "${ST[@]}" compare "$OUT/compare_$kind.yaml" --calibration "$CAL" --no-plots \
      -o "$OUT/compare_$kind"
  else
    summary "compare_$kind   skipped: no calibration file"
  fi
  # the shipped preset's prediction of the same run (no measurement): uncalibrated-vs-calibrated view
  PRESET=h200; [ "$SMALL" = "1" ] && PRESET=cpu
  case "$GPU_NAME" in *h100*) PRESET=h100-sxm;; *a100*) PRESET=a100-80g;; *l40s*) PRESET=l40s;; esac
  stage "preset_$kind" 25 "${ST[@]}" run "$OUT/compare_$kind.yaml" --set "hardware=$PRESET" --backend sim --no-progress \
    --set engine.device=cpu -o "$OUT/preset_$kind"
done
summary "total $(( $(date +%s) - T0 ))s"
grep -h -A3 -i "makespan\|p50" "$OUT"/compare_*/comparison.md 2>/dev/null | head -40 > "$OUT/compare_headlines.txt" || true
exit 0
