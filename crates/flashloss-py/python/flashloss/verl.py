"""``flashloss.verl`` is :mod:`flashloss.integrations.verl`, under its public name."""

from .integrations import alias

alias("verl")
