"""The working-set size of the fast paths, read at call time (``working_set.WORK_ELEMENTS``) so tests can patch it."""

WORK_ELEMENTS = 1 << 20  # values in one working temporary: passes over rows keep it cache-sized, not N-sized
