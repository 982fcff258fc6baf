"""A preload for the worker processes clusterkit starts on this machine: a worker process ends
without the interpreter's final garbage collection.

A worker holds distributed's whole heap, and the collection over it at exit was most of a
cluster's close: two local workers closed in 131 ms, 40 ms with this (6 interleaved pairs).
multiprocessing's fork children skip the interpreter's finalization altogether; this is milder.
Exit hooks and reference-counted cleanup still run; only cycles left at exit are not collected
(``gc.freeze``). It is registered as the worker starts, so every hook registered later (the
profile's own preloads, the tasks') runs before it.
"""

import atexit
import gc

atexit.register(gc.freeze)
