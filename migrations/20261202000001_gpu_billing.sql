-- GPU billing: what a run's GPUs cost, held and used (README: "The GPU bill").
-- bill_first_ms, bill_last_ms: the earliest and latest timestamp of this (node, rank)'s system
--   samples, on the sender's clock (the one its idle clock runs on); a future timestamp counts
--   as the proxy's receive time. The rank is billed from the first to the last.
ALTER TABLE run_ranks ADD COLUMN bill_first_ms BIGINT;
ALTER TABLE run_ranks ADD COLUMN bill_last_ms BIGINT;

-- Per GPU of a rank, the idle clock (gpu_<i>_idle_seconds) at the first and the last sample
-- known, and the idle seconds between them: the sum of the clock's increases from sample to
-- sample (a clock that fell started a new idle stretch and counts its own value), each capped to
-- the time between the two samples. Replicas merge their windows into the row in one statement.
CREATE TABLE IF NOT EXISTS rank_gpu_idle (
    run_id     TEXT             NOT NULL,
    node       TEXT             NOT NULL,
    rank       BIGINT           NOT NULL,
    gpu        BIGINT           NOT NULL,
    first_ms   BIGINT           NOT NULL,
    first_idle DOUBLE PRECISION NOT NULL,
    last_ms    BIGINT           NOT NULL,
    last_idle  DOUBLE PRECISION NOT NULL,
    idle_s     DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (run_id, node, rank, gpu)
);

-- A run to bill, once: queued when its client ended it through the proxy (runs/update with a
-- terminal status) or when the stale-run sweep carried out its verdict. The sweep's replica
-- claims a due bill as it claims a verdict (a claim left undone is taken over later), writes the
-- tags and marks it done with the figures.
CREATE TABLE IF NOT EXISTS run_bills (
    run_id       TEXT    PRIMARY KEY NOT NULL,
    ended_by     TEXT    NOT NULL, -- FINISHED, FAILED, KILLED (the client), or the sweep's outcome
    end_ms       BIGINT,           -- the end the bill stops at; NULL: the ranks' last samples
    due_ms       BIGINT  NOT NULL, -- not before: every replica has flushed what it heard by then
    replica      TEXT    NOT NULL DEFAULT '',
    claimed_ms   BIGINT  NOT NULL DEFAULT 0,
    done         BIGINT  NOT NULL DEFAULT 0,
    gpu_seconds  DOUBLE PRECISION,
    idle_seconds DOUBLE PRECISION
);
CREATE INDEX IF NOT EXISTS run_bills_due ON run_bills (done, due_ms);

-- The idle-GPU tag (mlscope.gpus_idle) last written on a live run, so it is written on change
-- only, whichever replica sweeps.
CREATE TABLE IF NOT EXISTS run_idle_tags (
    run_id     TEXT   PRIMARY KEY NOT NULL,
    value      TEXT   NOT NULL,
    written_ms BIGINT NOT NULL
);
