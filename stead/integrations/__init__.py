"""stead's flash checkpoints inside the training frameworks users already run.

* :mod:`stead.integrations.transformers`: Hugging Face ``Trainer`` (``pip install 'stead[transformers]'``);
* :mod:`stead.integrations.lightning`: PyTorch Lightning's ``Trainer`` and ``Fabric`` (``stead[lightning]``);
* :mod:`stead.integrations.accelerate`: ``Accelerator.save_state``/``load_state`` (``stead[accelerate]``).

Each module imports its framework and checks that its version is one the integration was
tested with; a script that uses one runs unchanged under plain ``torchrun`` (the flash
checkpoint then keeps only the saves it persists, on disk).
"""
