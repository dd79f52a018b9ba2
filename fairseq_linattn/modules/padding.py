"""Padding anywhere in a row, for a module whose ops count positions over the tokens as given (LAVO's): the
method runs over each row's real tokens, put first (``linattn.ops.real_tokens``). LLN+Diag's ops count real tokens
themselves."""
import functools

from linattn.ops.real_tokens import over_reordered_tokens, real_first_order, rows_in_real_first_order


def over_real_tokens(fn):
    """For a method whose blocks or windows count positions: ``fn(self, q, k, v, key_padding_mask, ...)`` runs
    with each row's real tokens first, so that padding anywhere (left padding too) changes no real token's
    output and real tokens are counted as fairseq counts their positions (docs/design.md §1.2)."""
    @functools.wraps(fn)
    def run(self, q, k, v, key_padding_mask=None, *args, **kwargs):
        reordered = None if self.cross else real_first_order(key_padding_mask)
        if reordered is None:
            return fn(self, q, k, v, key_padding_mask, *args, **kwargs)
        return over_reordered_tokens(functools.partial(fn, self), q, k, v, *reordered, *args, **kwargs)
    return run


def rows_over_real_tokens(fn):
    """``over_real_tokens`` for ``attention_rows(self, q, k, key_padding_mask, rows, lln)``: the matrix of the
    reordered tokens, put back in the tokens' own order (rows and columns)."""
    @functools.wraps(fn)
    def run(self, q, k, key_padding_mask=None, rows=None, lln=None):
        if self.cross:
            return fn(self, q, k, key_padding_mask, rows, lln)
        return rows_in_real_first_order(functools.partial(fn, self), q, k, key_padding_mask, rows, lln)
    return run
