"""Imported by the harness's fork server after its other preloads: freezes the gc.

This module exists for its one side effect. The fork server has imported
torch (about 170,000 objects tracked by the garbage collector); every rank is
a ``fork()`` of it. Left alone, every full collection in a rank walks all
those inherited objects, writing to their headers, which copies nearly every
page of the inherited heap: ``gc.collect()`` took 170 ms in each of 4 ranks
on 2 cores, against 0.3 ms with the freeze. And it comes at a random moment
inside the code under test. :func:`gc.freeze` moves the
objects that exist now to a permanent generation that collections skip, as
the :mod:`gc` documentation recommends before forking. Objects created later,
in the ranks, are collected as usual.

Importing this module anywhere but in the fork server would only stop the
collector from freeing that process's existing garbage cycles.
"""

import gc

gc.freeze()
