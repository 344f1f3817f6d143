"""What one training step is, with no device in sight: the ``Workload`` (model, sample batch, loss,
optimizer, AMP, mode), the calling convention, batch trees resized from a sample, the bitwise state
snapshot, compiled models, and calling a workload factory.

The lowest layer: imports torch and nothing else of batchfit but ``errors``.
"""
