"""fairseq_linattn: linear-complexity attention for fairseq (``--user-dir fairseq_linattn``).

Layers (docs/design.md §9): ``ops`` (pure PyTorch) -> ``modules`` (fairseq attention modules) ->
``models`` (registered fairseq models) -> ``plugin`` (the glue) and the commands. ``methods`` declares
every attention method once.

Importing the package (or ``fairseq_linattn.ops``) imports no fairseq and patches nothing. The plugin
registers its models and applies its fairseq fixes (``plugin.register``) as soon as fairseq is
imported: at once if it already is (``--user-dir``, ``from_pretrained(user_dir=...)``), else right after
a later ``import fairseq``. fairseq imports a user-dir only once per process, so a process that
imported ``fairseq_linattn`` before fairseq still finds the models registered.
"""
import importlib.abc
import importlib.util
import logging
import sys


def register() -> None:
    """Register the plugin's models with fairseq and apply its fairseq fixes (idempotent; ``plugin.register``)."""
    from . import plugin

    plugin.register()


def _half_imported() -> bool:
    """True while one of the plugin's own modules is being imported (it then registers when it is done:
    ``modules/__init__.py``)."""
    return any(name.startswith(__name__ + ".") and getattr(getattr(m, "__spec__", None), "_initializing", False)
               for name, m in list(sys.modules.items()))


class _RegisterAfterFairseqImport(importlib.abc.MetaPathFinder):
    """Calls ``register`` once ``import fairseq`` has finished, with fairseq's import kept quiet.

    Some of fairseq's modules call ``logging.basicConfig`` (level DEBUG) when imported: on an
    unconfigured root logger a placeholder handler makes that a no-op; a caller's own set-up is kept.
    """

    def find_spec(self, name, path=None, target=None):
        if name != "fairseq":
            return None
        sys.meta_path.remove(self)  # find the real spec without finding ourselves again
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_fairseq = spec.loader.exec_module

        def exec_module(module):
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            root = logging.getLogger()
            placeholder = None if root.handlers else logging.NullHandler()
            if placeholder is not None:
                root.addHandler(placeholder)
            try:
                exec_fairseq(module)
                if not _half_imported():
                    register()
            finally:
                if placeholder is not None:
                    root.removeHandler(placeholder)

        spec.loader.exec_module = exec_module
        return spec


if "fairseq" in sys.modules:
    register()
elif not any(isinstance(finder, _RegisterAfterFairseqImport) for finder in sys.meta_path):
    sys.meta_path.insert(0, _RegisterAfterFairseqImport())
