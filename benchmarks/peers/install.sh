#!/usr/bin/env bash
# Install the peer CRF libraries that benchmarks/bench_peers.py compares crfkit with, WITHOUT
# letting pip touch the installed torch (several peers pin or resolve an old one):
#     bash benchmarks/peers/install.sh
# Each peer is installed with --no-deps at the version the adapters were written against, then
# only its small missing dependencies are installed by name. Afterwards torch's version is
# checked to be unchanged.
#
# Which peers `pip install -e ".[bench]"` also installs (normal resolution, torch untouched):
# torch-struct, pytorch-crf, allencrf, TorchCRF, pytorchcrf. Not listed there:
#   pyt-crf          its metadata requires Python >= 3.12 (the code runs on 3.11): needs
#                    --ignore-requires-python here
#   transformers-crf pins transformers==4.56.1 and pulls in ~50 packages (datasets, onnx,
#                    onnxruntime, optimum, wandb, ...); the benchmark only uses its crf.py,
#                    which needs torch alone: installed with --no-deps here
set -euo pipefail
PYTHON=${PYTHON:-python}
PIP="$PYTHON -m pip"
torch_before=$($PYTHON -c "import torch; print(torch.__version__)")

$PIP install --no-deps \
    "torch-struct==0.5" \
    "pytorch-crf==0.7.2" \
    "allencrf==1.0.2" \
    "TorchCRF==1.1.0" \
    "pytorchcrf==1.2.0" \
    "transformers-crf==0.3.2"
$PIP install --no-deps --ignore-requires-python "pyt-crf==0.1.2"
# their small dependencies (numpy: TorchCRF, allencrf; pytest: allencrf), and matplotlib for the plot
$PYTHON -c "import numpy" 2>/dev/null || $PIP install numpy
$PYTHON -c "import pytest" 2>/dev/null || $PIP install pytest
$PYTHON -c "import matplotlib" 2>/dev/null || $PIP install matplotlib

torch_after=$($PYTHON -c "import torch; print(torch.__version__)")
if [ "$torch_before" != "$torch_after" ]; then
    echo "torch changed from $torch_before to $torch_after" >&2
    exit 1
fi
echo "peers installed; torch $torch_after untouched"
