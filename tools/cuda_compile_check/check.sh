#!/bin/sh
# Compile-check every csrc/cuda/*.cu with nvcc against torch's headers (see check.py).
exec python "$(dirname "$0")/check.py" "$@"
