"""Importing this module runs :func:`flashloss.verl.patch`: the way to patch verl's worker
processes (Ray actors), which import what verl's configuration names::

    actor_rollout_ref.model.external_lib=flashloss.verl_autopatch   # imported by HFModelConfig
    VERL_USE_EXTERNAL_MODULES=flashloss.verl_autopatch               # imported by `import verl`

``flashloss.verl.unpatch()`` undoes it as it undoes a call to ``patch``.
"""

from .verl import patch

patch()
