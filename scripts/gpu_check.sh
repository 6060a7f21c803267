#!/usr/bin/env bash
# GPU checks of the torch backend on a CUDA machine (torch, transformers installed; flash-attn,
# network and the model hub not needed). Run from anywhere:  bash scripts/gpu_check.sh
# Results: $OUT/gpu_check.json and $OUT/gpu_check.log (OUT defaults to ./gpu_check_out).
# Budget: a few minutes; hard-capped at 7 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export SERVETWIN_CACHE="${SERVETWIN_CACHE:-${TMPDIR:-/tmp}/servetwin_cache}"
export OUT="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] && .venv/bin/python -c "import torch; assert torch.cuda.is_available()" 2>/dev/null && PY=.venv/bin/python
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/nvidia_smi.txt" 2>&1 || true
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__)" | tee "$OUT/versions.txt"
timeout 420 "$PY" scripts/gpu_check.py
rc=$?
echo "gpu_check exit status: $rc" | tee -a "$OUT/versions.txt"
exit $rc
