"""The worker's private engine: one module per step of a batch, and the objects that own its state.

Read in this order: :mod:`.request` (the record), :mod:`.tracker` (the only writer of a request's
lifecycle), :mod:`.dispatcher` (queues into batches), :mod:`.pipeline` (one batch, step by step:
:mod:`.hashing`, :mod:`.batch_keys`, :mod:`.claims`, :mod:`.plan`, :mod:`.transfer` with
:mod:`.regions` and :mod:`.answers`), :mod:`.summary` (codes into results), :mod:`.lanes` (threads).
"""
