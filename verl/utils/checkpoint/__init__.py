"""Checkpoint managers (FSDP2 via torch.distributed.checkpoint) and resume helpers."""
