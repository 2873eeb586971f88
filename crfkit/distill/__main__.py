"""python -m crfkit.distill: the distillation tool (crfkit.tool)."""
import sys

from ..tool import main

sys.exit(main())
