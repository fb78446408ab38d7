"""stead's flash checkpoints inside the training frameworks users already run.

* :mod:`stead.integrations.transformers`: Hugging Face ``Trainer`` (``pip install 'stead[transformers]'``);
* :mod:`stead.integrations.lightning`: PyTorch Lightning's ``Trainer`` and ``Fabric`` (``stead[lightning]``);
* :mod:`stead.integrations.accelerate`: ``Accelerator.save_state``'s state (``stead[accelerate]``);
* :mod:`stead.integrations.deepspeed`: a DeepSpeed engine's checkpoint, ZeRO stages 0-3 (``stead[deepspeed]``).

Each module imports its framework and checks that its version is one the integration was
tested with (:func:`require_version`, :class:`IntegrationError`); a script that uses one runs
unchanged under plain ``torchrun`` (the flash checkpoint then keeps only the saves it
persists, on disk). This package itself imports no framework.
"""

from stead.integrations._common import IntegrationError, require_version

__all__ = ["IntegrationError", "require_version"]
