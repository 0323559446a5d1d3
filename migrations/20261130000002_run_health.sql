-- Run health: the last heartbeat of every (run, node, rank) the proxy saw samples from, what the
-- collector's wrapper reported about how a rank ended, and where it ran. Replicas write their
-- share in batches; timestamps are unix milliseconds on the writing proxy's clock.
CREATE TABLE IF NOT EXISTS run_ranks (
    run_id          TEXT   NOT NULL,
    node            TEXT   NOT NULL, -- '' when the sender named no node
    rank            BIGINT NOT NULL, -- -1 when the sender named no rank
    first_heard_ms  BIGINT NOT NULL,
    last_heard_ms   BIGINT NOT NULL,
    interval_ms     BIGINT,          -- last gap between two heartbeats: the sampling interval
    outcome         TEXT,            -- exited, killed, oom_killed, not_started (from the wrapper)
    exit_code       BIGINT,
    ended_ms        BIGINT,
    pod             TEXT,
    memory_limit_mb DOUBLE PRECISION,
    cpu_limit_cores DOUBLE PRECISION,
    gpu_model       TEXT,
    gpus            BIGINT NOT NULL DEFAULT 0, -- GPUs the rank's samples name
    gpu_idle        TEXT,            -- JSON array: seconds each GPU had been idle at gpu_idle_ms
    gpu_idle_ms     BIGINT,
    PRIMARY KEY (run_id, node, rank)
);
CREATE INDEX IF NOT EXISTS run_ranks_last_heard ON run_ranks (last_heard_ms);

-- What the stale-run sweep decided about a run, and whether it has done it. A replica claims a
-- run by inserting its row; a claim left undone (the replica died) may be taken over later.
CREATE TABLE IF NOT EXISTS run_verdicts (
    run_id     TEXT    PRIMARY KEY NOT NULL,
    outcome    TEXT    NOT NULL, -- lost, killed, oom_killed, failed, not_started; finished, ended_by_client
    action     TEXT    NOT NULL, -- end, tag, none
    detail     TEXT    NOT NULL,
    replica    TEXT    NOT NULL,
    claimed_ms BIGINT  NOT NULL,
    done       BIGINT  NOT NULL  -- 0 while being carried out, 1 when done
);

-- Named leases for work one replica does at a time (the stale-run sweep).
CREATE TABLE IF NOT EXISTS work_leases (
    name       TEXT   PRIMARY KEY NOT NULL,
    holder     TEXT   NOT NULL,
    expires_ms BIGINT NOT NULL
);
