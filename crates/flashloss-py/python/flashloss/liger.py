"""``flashloss.liger`` is :mod:`flashloss.integrations.liger`, under its public name."""

from .integrations import alias

alias("liger")
