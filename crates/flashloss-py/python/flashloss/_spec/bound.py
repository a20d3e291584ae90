"""An argument class built from a call's bound arguments: a public function passes its
``locals()`` (taken first thing; its closures take what they need as default arguments,
since ``torch.compile`` cannot read an unbound cell) and gets the class's fields by name,
so no function writes a list of the fields by hand (the signatures are checked against the classes by
``tests/test_api_parity.py``)."""

from __future__ import annotations

from typing import Any, Mapping, TypeVar

T = TypeVar("T", bound="Bound")


class Bound:
    """A mixin for the frozen dataclasses of :mod:`flashloss._spec`."""

    @classmethod
    def names(cls) -> tuple:
        """The fields' names, in the order of the public signatures (read from the
        dataclass's field table, which ``torch.compile`` traces)."""
        return tuple(cls.__dataclass_fields__)

    @classmethod
    def fields_of(cls, bound: Mapping[str, Any], **given: Any) -> dict:
        """The fields among ``bound`` (a call's ``locals()``), ``given`` added or overriding."""
        picked = {name: bound[name] for name in cls.names() if name in bound}
        picked.update(given)
        return picked

    @classmethod
    def of_bound(cls: type[T], bound: Mapping[str, Any], **given: Any) -> T:
        """The class of :meth:`fields_of`'s fields."""
        return cls(**cls.fields_of(bound, **given))
