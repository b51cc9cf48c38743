"""What each role answers, by name: the endpoints a caller asks for (runtime/transport.py).

A caller imports this module, never the role that answers, so the oracle, the servers and the trainers do not
import each other. Each role serves an object of handlers whose methods carry these names (the ``Oracle`` in
runtime/oracle/service.py, ``ServerHandlers`` in runtime/server/handlers.py, ``TrainerHandlers`` in
runtime/trainer/handlers.py; tests/unit/project/test_imports.py checks that every endpoint has its handler).
"""

from __future__ import annotations

from bagpipe.runtime.transport import Endpoint


class OracleEndpoints:
    """The oracle (RPC name ``oracle``)."""

    server_ready = Endpoint("oracle", "server_ready")  # (name): a server is ready to serve
    pull = Endpoint("oracle", "pull")  # (trainer, after, max_steps, finished, written) -> Pulled
    replaced = Endpoint("oracle", "replaced")  # (rank, info): a lost process's replacement has joined
    ready_to_take_over = Endpoint("oracle", "ready_to_take_over")  # (rank): a data server has copied its shard
    trainer_done = Endpoint("oracle", "trainer_done")  # (trainer, stats, dense_state)
    # (boundary, trainer, dense, dense_optimizer, parts, extra): a trainer's part of a checkpoint
    checkpoint_cache = Endpoint("oracle", "checkpoint_cache")
    row_keys = Endpoint("oracle", "row_keys")  # (space, shard) -> raw ids: the keys of a shard's rows, per table


class ServerEndpoints:
    """An embedding server, data or parity (RPC names ``server0``, ``server1``, ...)."""

    # (space, keys, versions, tag) -> (rows, state, versions, tag, digest)
    fetch = Endpoint("server", "fetch", later=True)
    write_back = Endpoint("server", "write_back", later=True)  # (space, keys, rows, state, version)
    read_range = Endpoint("server", "read_range")  # (space, start, stop) -> (rows, state, versions)
    read_rows = Endpoint("server", "read_rows")  # (space, local) -> (rows, state, versions)
    parity_apply = Endpoint("server", "parity_apply")  # (space, member, local, delta, before, version)
    check_parity = Endpoint("server", "check_parity")  # () -> the parity checked against its group
    dump = Endpoint("server", "dump")  # () -> every row held, for an export
    begin_checkpoint = Endpoint("server", "begin_checkpoint")  # (boundary, expected_rows, since, directory, shard)
    checkpoint_written = Endpoint("server", "checkpoint_written", later=True)  # (boundary)
    stand_in = Endpoint("server", "stand_in")  # (shard): a parity server serves a lost data server's shard
    stand_in_rebuilt = Endpoint("server", "stand_in_rebuilt", later=True)  # (shard)
    hand_over = Endpoint("server", "hand_over")  # (shard) -> (versions, received): the stand-in frozen
    keep_standing_in = Endpoint("server", "keep_standing_in")  # (shard): the hand-over failed
    handed_back = Endpoint("server", "handed_back")  # (shard): the replacement serves it
    take_over = Endpoint("server", "take_over")  # (versions, received) -> figures: a replacement takes its shard


class TrainerEndpoints:
    """A trainer (RPC names ``trainer0``, ``trainer1``, ...)."""

    recovery = Endpoint("trainer", "recovery")  # (trainer) -> Recovery: what a lost trainer's replacement redoes
    handed_over = Endpoint("trainer", "handed_over")  # (trainer) -> state, at an iteration boundary
    progress = Endpoint("trainer", "progress")  # () -> how far it is, for a lost oracle's replacement


ORACLE, SERVER, TRAINER = OracleEndpoints, ServerEndpoints, TrainerEndpoints
