"""``flashloss.transformers`` is :mod:`flashloss.integrations.transformers`, under its public name."""

from .integrations import alias

alias("transformers")
