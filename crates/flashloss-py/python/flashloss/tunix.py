"""``flashloss.tunix`` is :mod:`flashloss.integrations.tunix`, under its public name."""

from .integrations import alias

alias("tunix")
