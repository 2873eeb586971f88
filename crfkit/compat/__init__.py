"""Drop-in replacements for the CRF layers of two peer libraries, computed by crfkit's ops.

    from crfkit.compat.pytorch_crf import CRF                           # was: from torchcrf import CRF
    from crfkit.compat.allennlp import ConditionalRandomField, allowed_transitions
        # was: from allennlp.modules.conditional_random_field import ...

Each class keeps its peer's constructor, parameter names (so saved state_dicts load), input
layout and return values; see the submodules for the few documented differences. The
submodules are not imported here: `import crfkit.compat` costs nothing.
"""
