"""``flashloss.verl_autopatch`` is :mod:`flashloss.integrations.verl_autopatch`, under its public name."""

from .integrations import alias

alias("verl_autopatch")
