"""Device-independent measures of an op's GPU shape, taken on any device: ATen ops and host syncs
(``dispatch``), bytes saved for backward (``saved``)."""
from .dispatch import DispatchCounts, count_dispatch
from .saved import saved_bytes
