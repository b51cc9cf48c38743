#!/usr/bin/env bash
# Creates .venv-torchrec at the repository root with TorchRec running on CPU, for the peer
# benchmark (benchmarks/peer/torchrec_dlrm.py). Idempotent: a marker file records what was
# installed, and a second run with the same versions does nothing.
#
#     bash benchmarks/peer/setup_torchrec.sh          # PYTHON=python3.11 ... to choose the interpreter
#
# Versions (overridable through the environment):
#   torch 2.13.0 (pinned: unpinned, pip would pull the CUDA build and gigabytes of NVIDIA wheels),
#   torchrec installed with --no-deps (its declared dependency fbgemm-gpu is the CUDA build),
#   fbgemm-gpu-cpu 1.8.0 (1.9.0 does not load with torch 2.13), torchmetrics 1.0.3, and
#   tensordict, tqdm, pyre-extensions, numpy installed against a constraints file that pins torch,
#   so that nothing can upgrade or replace it.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${TORCHREC_VENV:-$ROOT/.venv-torchrec}"
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
TORCHREC_SPEC="${TORCHREC_SPEC:-torchrec==1.9.2}"
FBGEMM_SPEC="${FBGEMM_SPEC:-fbgemm-gpu-cpu==1.8.0}"
TORCHMETRICS_SPEC="${TORCHMETRICS_SPEC:-torchmetrics==1.0.3}"
MARKER="$VENV/.peer-torchrec-installed"
WANTED="$TORCH_SPEC $TORCHREC_SPEC $FBGEMM_SPEC $TORCHMETRICS_SPEC tensordict tqdm pyre-extensions numpy"

fail() {
    echo "setup_torchrec.sh: FAILED: $*" >&2
    echo "setup_torchrec.sh: the environment at $VENV is incomplete; fix the cause and run this script again" >&2
    exit 1
}

if [[ -f "$MARKER" && "$(cat "$MARKER")" == "$WANTED" && -x "$VENV/bin/python" ]]; then
    echo "setup_torchrec.sh: already installed in $VENV ($WANTED)"
    echo "setup_torchrec.sh: python: $VENV/bin/python"
    exit 0
fi
rm -f "$MARKER"

command -v "$PYTHON" >/dev/null || fail "no Python interpreter '$PYTHON' (set PYTHON=...)"
if [[ ! -x "$VENV/bin/python" ]]; then
    echo "setup_torchrec.sh: creating $VENV with $("$PYTHON" --version 2>&1)"
    "$PYTHON" -m venv "$VENV" || fail "could not create the virtual environment $VENV"
fi
LOG="$(mktemp)"
CONSTRAINTS="$(mktemp)"
trap 'rm -f "$LOG" "$CONSTRAINTS"' EXIT

# pip_install WHAT ARGS...: quiet unless pip fails, then its output and a clear message.
pip_install() {
    local what="$1"; shift
    if ! "$VENV/bin/python" -m pip install --disable-pip-version-check -q "$@" >"$LOG" 2>&1; then
        cat "$LOG" >&2
        fail "pip install of $what"
    fi
}

echo "setup_torchrec.sh: installing $TORCH_SPEC"
pip_install "$TORCH_SPEC" "$TORCH_SPEC" numpy

# Pin exactly the torch now installed (e.g. 2.13.0+cpu) for every later step.
TORCH_VERSION="$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')" \
    || fail "torch does not import after installing $TORCH_SPEC"
echo "torch==$TORCH_VERSION" >"$CONSTRAINTS"

echo "setup_torchrec.sh: installing $TORCHREC_SPEC and $FBGEMM_SPEC without their dependencies"
pip_install "$TORCHREC_SPEC $FBGEMM_SPEC" -c "$CONSTRAINTS" --no-deps "$TORCHREC_SPEC" "$FBGEMM_SPEC"

echo "setup_torchrec.sh: installing TorchRec's run-time dependencies (torch held at $TORCH_VERSION)"
# tensordict and torchmetrics depend on torch: the constraints file keeps the installed one.
# (pip's resolver then notes that torchrec wants fbgemm-gpu: fbgemm-gpu-cpu provides the same module.)
pip_install "$TORCHMETRICS_SPEC tensordict tqdm pyre-extensions numpy" \
    -c "$CONSTRAINTS" "$TORCHMETRICS_SPEC" tensordict tqdm pyre-extensions numpy

echo "setup_torchrec.sh: checking that TorchRec and fbgemm's CPU operators load"
"$VENV/bin/python" - "$TORCH_VERSION" <<'EOF' || fail "TorchRec does not import or its fbgemm operators do not load (see above)"
import sys
import torch
if torch.__version__ != sys.argv[1]:
    sys.exit(f"torch changed from {sys.argv[1]} to {torch.__version__} during the install")
import fbgemm_gpu  # noqa: F401  registers torch.ops.fbgemm
import torchrec
from torchrec.distributed.model_parallel import DistributedModelParallel  # noqa: F401
from torchrec.models.dlrm import DLRM  # noqa: F401
torch.ops.fbgemm.asynchronous_complete_cumsum(torch.tensor([1, 2], dtype=torch.int64))
print(f"setup_torchrec.sh: torch {torch.__version__} (CUDA build: {torch.version.cuda is not None}), "
      f"torchrec {getattr(torchrec, '__version__', '?')}")
EOF

echo "$WANTED" >"$MARKER"
echo "setup_torchrec.sh: installed in $VENV"
echo "setup_torchrec.sh: python: $VENV/bin/python"
