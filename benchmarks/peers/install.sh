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
#   hmmlearn, torbi  see below (torbi is compiled from its sdist against this torch)
# pytorch-crf-compiled is pytorch-crf under torch.compile: nothing more to install.
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
# hmmlearn: only its compiled hmmlearn._hmmc is used, which needs numpy alone; its declared
# scipy and scikit-learn (for its model classes, no torch) are installed if missing.
$PIP install --no-deps "hmmlearn==0.3.3"
$PYTHON -c "import scipy, sklearn" 2>/dev/null || $PIP install scipy scikit-learn
# torbi: the 1.4.1 wheel carries prebuilt libraries for torch 2.6 - 2.11 only, which do not load
# on a newer torch (undefined symbols); the 1.3.3 sdist is compiled here against the installed
# torch (--no-build-isolation: no second torch; needs a C++ compiler, about 30 s). Its declared
# dependencies are not installed: torchaudio would bring a torch of its own, and torchutil
# (tensorboard, apprise, ...) and yapecs are only imported by torbi's package __init__, which
# the adapter does not run (it loads the compiled operator itself: see torbi_peer.py).
USE_CUDA=0 MAX_JOBS=1 $PIP install --no-deps --no-build-isolation "torbi==1.3.3"
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
# pytorch-partial-crf (benchmarks/bench_new_ops.py, partial log-likelihood): pure Python; its metadata
# pins torch < 2 and pytest < 7, which it does not need at run time (it imports torch alone and runs
# under torch 2.13), so --no-deps; it cannot change torch.
$PIP install --no-deps "pytorch-partial-crf==0.2.1"
$PYTHON -c "import pytorch_partial_crf" && echo "pytorch-partial-crf installed; torch $($PYTHON -c 'import torch; print(torch.__version__)') untouched"
