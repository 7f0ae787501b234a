"""The training job around the builder: trainer, data, tokenizers, checkpoints, metrics, validation, guards."""
