"""Registered fairseq models: linattn_roberta, linattn_lm, linattn_transformer (docs/design.md §7)."""
from . import linattn_lm, linattn_roberta, linattn_transformer  # noqa: F401
