"""The pipeline at run time: the `Pipeline` object, its loss, gradient reduction and forward-only evaluation."""
