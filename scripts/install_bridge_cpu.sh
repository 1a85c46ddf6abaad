#!/usr/bin/env bash
# Megatron-Bridge 0.6.2 beside megatron-core 0.19.2 in its own environment, on a CPU-only machine
# (docs/bridge.md, "The blockers" says why each step is as it is):
#   bash scripts/install_bridge_cpu.sh [VENV]          (default .venv-bridge; about 4 minutes, 8.8 GB)
# A finished environment is left as it is (a stamp file records it); delete the folder to rebuild.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv-bridge}
STAMP="$VENV/.installed-bridge-0.6.2"
if [ -f "$STAMP" ]; then
    echo "$VENV: Megatron-Bridge environment already built ($STAMP)"
    exit 0
fi

PY=$(PYENV_VERSION=$(pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.|$)' | tail -n 1) \
    pyenv which python3.12 2>/dev/null) || PY=$(command -v python3.12) || {
    echo "install_bridge_cpu: Megatron-Bridge 0.6.2 needs Python 3.12 (pyenv or PATH); none found" >&2; exit 1; }
step() { echo "[install_bridge_cpu] $(date +%T) $*"; }

step "environment $VENV with $PY"
"$PY" -m venv "$VENV"
PIP=("$VENV/bin/pip" install --quiet --progress-bar off)
step "torch"
"${PIP[@]}" torch
step "megatron-core 0.19.2 and megatron-bridge 0.6.2 without their requirements (fast-hadamard-transform needs nvcc)"
"${PIP[@]}" --no-deps megatron-core==0.19.2 megatron-bridge==0.6.2
step "Bridge's declared requirements, fast-hadamard-transform left out"
"${PIP[@]}" "transformers<=5.12.1,>=5.8" "mistral-common>=1.10.0" "peft>=0.18.1" "datasets>=2.20.0" accelerate \
    "diffusers>=0.36.0" einops "omegaconf>=2.3.0" "tensorboard>=2.19.0" rich "wandb==0.29.0" "six>=1.17.0" \
    "regex>=2024.11.6" "pyyaml>=6.0.2" "tqdm>=4.67.1" "hydra-core<1.4,>=1.3.4" "megatron-core[mlm]==0.19.2" \
    qwen-vl-utils nvidia-resiliency-ext flash-linear-attention timm "open-clip-torch>=3.2.0" "mlflow>=3.16.0" \
    "comet-ml>=3.50.0" "flashinfer-python==0.6.8.post1" "flashinfer-cubin==0.6.8.post1"
step "nvidia-resiliency-ext removed again: 0.4.1, the registry's newest, breaks import megatron.core 0.19.2"
"$VENV/bin/pip" uninstall --quiet -y nvidia-resiliency-ext
step "what Bridge imports without declaring it: megatron-energon, nvidia-modelopt"
"${PIP[@]}" "megatron-energon~=7.0" "nvidia-modelopt[torch]>=0.44"
step "megatron_patches (editable) and pytest"
"${PIP[@]}" -e . pytest
touch "$STAMP"
step "done: $(du -sh "$VENV" | cut -f1) in $VENV"
