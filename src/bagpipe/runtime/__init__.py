"""The distributed runtime: oracle, embedding servers and trainers over torch.distributed."""
