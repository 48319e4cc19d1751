"""Errors raised while loading or running models."""


class ModelError(Exception):
    """Base class of every error raised by ``models/``."""


class ModelSourceError(ModelError):
    """A model ``source`` does not name a loadable model (missing path, package or file)."""


class LoraAdapterError(ModelError):
    """A LoRA adapter folder Sluice cannot serve over its base model (missing, not plain LoRA,
    too large a rank, or shapes that do not match). ``param`` names what is at fault: an
    ``adapter_config.json`` key, or ``"path"`` for the folder, its files and its tensors' shapes."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param
