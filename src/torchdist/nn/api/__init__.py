"""``torchdist.nn.api``: RemoteModule's home (:mod:`.remote_module`), at ``torch.distributed.nn.api``'s path."""
