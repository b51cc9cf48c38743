"""A lost oracle replaced while training goes on: the local launcher serves the job's store, so it outlives the oracle;
the same command started again takes the job over (runtime/succession.py): it re-forms the RPC world around itself,
asks the trainers how far they are, plans again from the start (a pure function of the data and the configuration)
and sends each trainer only what it does not have. The job ends bit for bit as the sliced reference, with no
restart; what it cannot take over restarts the job from its newest checkpoint, as before."""

import dataclasses
import threading


from bagpipe.runtime.succession import Failure, JobRecord, replayed_from
from bagpipe.runtime.world import World
from helpers.jobs import job_config


def _tensors(message):
    return [t for t in (message.dense_x, message.ids, message.target) if t is not None] + [
        t for space in message.spaces for t in space.tensors()]


def test_what_a_replacement_cannot_take_over_is_named():
    world = World(rank=0, world_size=5, num_trainers=2)
    assert JobRecord(started_at=0.0).why_not_replaceable(world) is None
    back = Failure(role="server 0", rank=3, at=1.0, epoch=1, replaced=True)
    assert JobRecord(started_at=0.0, failures=[back]).why_not_replaceable(world) is None
    assert "trainer 1 had reported done" in JobRecord(started_at=0.0, done=[1]).why_not_replaceable(world)
    assert "replacement for server 1 was under way" in JobRecord(started_at=0.0, replacing=[4]).why_not_replaceable(
        world)
    assert "server 0 was lost for good" in JobRecord(
        started_at=0.0, failures=[Failure(role="server 0", rank=3, at=1.0, replaced=False)]).why_not_replaceable(world)
    record = JobRecord(started_at=1.5, servers_ready=["server0"], done=[0], failures=[
        Failure(role="server 1", rank=4, at=2.0, server=1, parity_server=2, moved_in_s=0.01),
        dataclasses.replace(back, figures={"rows_copied": 287, "handover_s": 0.02})])
    assert JobRecord.from_json(record.to_json()) == record
    # as summary.json has them: flat, without what does not apply
    assert record.failures[1].to_dict() == {"role": "server 0", "rank": 3, "at": 1.0, "epoch": 1, "replaced": True,
                                            "rows_copied": 287, "handover_s": 0.02}
    assert record.failures[0].moved_for_good and not record.failures[1].moved_for_good


def test_a_replacement_makes_the_plan_messages_again_from_redo_depth_before_the_slowest_trainer():
    progress = [{"after": 30, "finished": 25, "written": 24}, {"after": 28, "finished": 27, "written": 26}]
    assert replayed_from(progress, start=0, redo_depth=2) == 24
    assert replayed_from(progress, start=25, redo_depth=2) == 25  # never before the job's (resumed) start


def test_a_replacement_oracles_plan_messages_equal_the_lost_ones_and_each_trainer_gets_only_what_it_lacks(
        small_binary, tmp_path):
    """In one process: an oracle that takes over from trainers holding the plans up to 17 and 12 (stepped to 15 and
    11) makes every later message as the first oracle made it, keeps those from REDO_DEPTH before each trainer's last
    step (a lost trainer's replacement may pull them), and a pull after what a trainer has gets the next ones."""
    from bagpipe.data.binary import open_dataset
    from bagpipe.runtime.oracle.feed import Sent
    from bagpipe.runtime.redo import REDO_DEPTH
    from helpers.feeds import feed_of

    config = job_config(small_binary, tmp_path / "run", iterations=40)
    world = World(rank=0, world_size=5, num_trainers=2)
    dataset = open_dataset(small_binary)

    def pulled_all(feed, afters):  # every trainer's messages after ``afters``, pulled in turn (queues are bounded)
        messages = {trainer: [] for trainer in range(len(afters))}
        while not all(got and got[-1].final for got in messages.values()):
            for trainer, got in messages.items():
                if not (got and got[-1].final):
                    got += feed.pull(trainer, got[-1].iteration if got else afters[trainer], 8).messages
        return messages

    def started(feed):
        threading.Thread(target=feed.produce, daemon=True).start()
        return feed

    first = started(feed_of(config, world, dataset))
    expected = pulled_all(first, [-1, -1])
    first.state.stop.set()
    finished = [15, 11]
    second = started(feed_of(config, world, dataset, sent=Sent(
        before=[17, 12], finished=finished, written=[-1, -1],
        first=replayed_from([{"finished": f} for f in finished], start=0, redo_depth=REDO_DEPTH))))
    pulled = pulled_all(second, second.sent_before)
    for trainer, after in enumerate(second.sent_before):
        got = pulled[trainer]
        assert [m.iteration for m in got] == [m.iteration for m in expected[trainer][after + 1:]]
        for ours, theirs in zip(got, expected[trainer][after + 1:]):
            assert (ours.final, ours.checkpoint, ours.lookups) == (theirs.final, theirs.checkpoint, theirs.lookups)
            assert all(a.equal(b) for a, b in zip(_tensors(ours), _tensors(theirs), strict=True))
    # the messages kept for a lost trainer's replacement begin REDO_DEPTH before the slowest trainer's last step
    assert second.sent[1][0].iteration <= 11 - REDO_DEPTH + 1
    second.state.stop.set()
