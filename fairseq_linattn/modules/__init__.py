"""fairseq modules: attention with MultiheadAttention's interface, and the encoder/decoder using it."""
from .base import AttentionBase  # noqa: F401
from .build import ATTENTION_CLASSES, build_attention  # noqa: F401
from .moment_matcher import MomentMatcher  # noqa: F401

