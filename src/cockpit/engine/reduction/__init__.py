"""The one reduction point of a tracked step: the statistics of its backward passes merged
over micro-batches (:mod:`.step_reduction`), then combined over the processes of a
``torch.distributed`` group (:mod:`.ranks`: two all-reduces of flat buffers)."""
