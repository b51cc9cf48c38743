"""Every name the job's processes meet each other by, in one place: the job store's keys and key prefixes (the local
launcher, which serves the store, decides from them), and the events roles log to metrics.jsonl (for the run's
readers: reports, tests, a person)."""

# -- the job's store ----------------------------------------------------------------------------------------
SHAPE_KEY = "bagpipe/shape"
JOB_KEY = "bagpipe/job"
REFUSED_KEY = "bagpipe/refused"  # why the oracle refused the job, for the roles waiting on it
STOP_KEY = "bagpipe/stop"  # set by the oracle once training has ended and every row is gathered: servers leave
STATUS_KEY = "bagpipe/status"
HELLO_PREFIX = "bagpipe/hello/"
EPOCH_KEY = "bagpipe/epoch"  # the RPC world every process is to be in (Epochs): set by the oracle
REPLACE_PREFIX = "bagpipe/replace/"  # RANK -> the epoch a replacement for that rank's lost process joins
JOINING_PREFIX = "bagpipe/joining/"  # RANK -> set by the replacement once it is ready to join
ROUTE_PREFIX = "bagpipe/route/"
BEAT_PREFIX = "bagpipe/beat/"
LEFT_PREFIX = "bagpipe/left/"
EXITED_PREFIX = "bagpipe/exited/"  # set by a local launcher that saw the process end: lost at once
STATE_KEY = "bagpipe/oracle/record"  # the job's record (JobRecord), rewritten by the oracle at every change
LOST_AT_PREFIX = "bagpipe/lost-at/"  # RANK -> when the local launcher saw that process end (wall time)
SUMS_PREFIX = "bagpipe/trainers/sums/"  # EPOCH/TRAINER -> the sums a survivor of a lost trainer has not finished

# -- events in metrics.jsonl ----------------------------------------------------------------------------------
TRAINED = "trained"  # after it every row is back on the servers and gathered
TRAINER_DONE = "trainer done"  # a trainer reported: the job no longer needs it
RESUMED = "resumed"  # a resumed job's first iteration done (trainer 0 logs it)
SERVER_LOST = "server lost"  # a lost server (a data server's shard moved to its parity server)
TRAINER_LOST = "trainer lost"  # a lost trainer whose replacement the oracle awaits
SERVER_BACK = "server back"  # a lost data server's replacement took its shard back
ORACLE_REPLACED = "oracle replaced"  # a lost oracle's replacement serves plans again
