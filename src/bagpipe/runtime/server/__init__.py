"""The server role: the processes that hold the embedding tables.

- ``data``: a data server, one shard of every embedding space (a RowStore each).
- ``deltas``: a data server's write-backs' deltas to its group's parity server (``--parity``).
- ``parity``: a parity server, and the stand-in it becomes for a lost member's shard.
- ``takeover``: a lost data server's replacement taking its shard back from that stand-in.
- ``handlers``: what a server process answers (runtime/endpoints.py's ``SERVER``).
- ``main``: the role's process, ``run_server`` (``bagpipe server``), as stages.
"""
