"""fairseq modules: attention with MultiheadAttention's interface, and the encoder/decoder using it."""
from .attention import ATTENTION_CLASSES, AttentionBase, build_attention  # noqa: F401
from .moment_matcher import MomentMatcher  # noqa: F401
from ..options import AttentionOptions, check_attention_options  # noqa: F401
