"""Layer 4: transports move byte buffers between the ranks of a group.

- ``base``: the ``Transport`` interface the algorithms use, and ``Transfer``;
- ``framing``: the message header and op fingerprints; ``matching``: the rules
  that pair arriving messages with posted receives;
- ``tcp``: the interface over sockets, bootstrapped by ``mesh`` through the store;
  ``loopback``: in one process, for tests;
- ``shm``: the interface over rings in shared memory, on ``shm_board`` (every
  rank's segment, ``shm_segment``), with ``shm_steps`` (the synchronization of the
  direct shared-memory collectives) and ``shm_heap`` (symmetric memory);
- ``engine``: runs a group's ops in issue order over its transport;
  ``thread_roles``: which thread drives an engine, and where callbacks run.
"""
