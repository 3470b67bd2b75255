"""D side: the decode side's reads, from acceptance to completion.

``table`` (:class:`~kvsidecar.daemon.d_side.table.ReadTable`, what the service
uses) accepts reads and starts them in groups, one task each (``driver``:
link, claim, plan; ``waiting``: post, renew, scatter, verify): a read alone
is a group of one; the reads of one message, or of messages queued together
on one connection, over links already made a group of several. Each read's
state, abort, retry policy and completion are its pure ``book``; ``posting``,
``parts``, ``addresses``, ``series`` and ``verifying`` are the steps' pieces;
``rank`` is what a read sees of its engine rank.
"""
