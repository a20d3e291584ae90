"""``flashloss.trl`` is :mod:`flashloss.integrations.trl`, under its public name."""

from .integrations import alias

alias("trl")
