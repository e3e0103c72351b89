"""Layer 3: collective algorithms, written once over the transport interface.

``comm.Comm`` is all an algorithm sees of the network. ``ring`` (bandwidth-optimal),
``halving_doubling`` (Rabenseifner's all-reduce), ``recursive`` (recursive
doubling), ``direct`` (one-step exchanges, gather/scatter, all-to-all) and ``tree``
(broadcast, reduce, barrier) implement the algorithms; ``select`` picks one by
message and group size; ``collectives`` is the entry point backends call;
``reduction`` holds the in-place combiners. ``shm_direct`` has the same entry points
for shared memory, where ranks read each other's memory instead of messages.
"""
