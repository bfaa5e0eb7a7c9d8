"""The worker's private engine: one module per step of a batch, and the objects that own its state.

Read in this order: :mod:`.request` (the record), :mod:`.tracker` (the only writer of a request's
lifecycle), :mod:`.dispatcher` (queues into batches), :mod:`.pipeline` (one batch, step by step:
:mod:`.hashing`, :mod:`.batch`, :mod:`.plan`, :mod:`.transfer` with
:mod:`.call_split` and :mod:`.answers`), :mod:`.summary` (codes into results), :mod:`.lanes` (threads).
"""
