"""crfkit.taggers: sequence taggers built on a crfkit CRF, saved and loaded as folders.

    TransformerCRFTagger   a pretrained encoder (MiniLM-L6 by default) + casing + linear + CRF
    BiLSTMCRFTagger        word embeddings + casing (+ char CNN) + BiLSTM + linear + CRF
    load_tagger(dir)       any saved tagger; tagger.predict([["EU", "rejects", ...]])

Training lives in crfkit.training (transformers' Trainer); the command line in crfkit.tag and
crfkit.pipeline.
"""
from .base import CRFTagger, load_tagger
from .bilstm import BiLSTMCRFTagger
from .casing import CASING_CLASSES, casing_id, casing_ids
from ..packaged import encoder_path
from .transformer import TransformerCRFTagger

__all__ = ["BiLSTMCRFTagger", "CASING_CLASSES", "CRFTagger", "TransformerCRFTagger", "casing_id", "casing_ids",
           "encoder_path", "load_tagger"]
