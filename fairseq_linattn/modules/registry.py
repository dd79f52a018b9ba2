"""``ATTENTION_CLASSES``: each method's module class by its registry name, filled by ``@register_attention``
on the class (in ``modules/<method>.py``); ``modules/build.py`` imports every such file."""
from typing import Callable, Dict

from linattn.methods import METHODS

ATTENTION_CLASSES: Dict[str, type] = {}


def register_attention(method: str) -> Callable[[type], type]:
    """Class decorator: the module class of ``method`` (a name in ``linattn.methods.METHODS``), which it sets as
    the class's ``method``; one class per method."""
    if method not in METHODS:
        raise ValueError(f"{method!r} is not a method of linattn.methods.METHODS")

    def register(cls: type) -> type:
        if method in ATTENTION_CLASSES:
            raise ValueError(f"{method} already has its module class, {ATTENTION_CLASSES[method].__name__}")
        cls.method = method
        ATTENTION_CLASSES[method] = cls
        return cls
    return register
