-- What a run's ranks used, for its report (README: "The run report"): per (run, node, rank) and
-- series (memory, cpu, throttled, gpu_sm, gpu_util, oom_kills; step under node '' and rank -1),
-- buckets of samples aligned to multiples of their width since the epoch. Replicas add their
-- share to the same bucket; the sweep merges a series of more than 240 buckets into wider ones.
CREATE TABLE IF NOT EXISTS rank_series (
    run_id    TEXT             NOT NULL,
    node      TEXT             NOT NULL,
    rank      BIGINT           NOT NULL,
    series    TEXT             NOT NULL,
    bucket_ms BIGINT           NOT NULL, -- the bucket's start (the sender's clock, unix ms)
    width_ms  BIGINT           NOT NULL,
    n         BIGINT           NOT NULL, -- samples
    total     DOUBLE PRECISION NOT NULL, -- their sum
    peak      DOUBLE PRECISION NOT NULL,
    peak_ms   BIGINT           NOT NULL, -- when the peak was measured
    low       DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (run_id, node, rank, series, bucket_ms, width_ms)
);

-- A histogram of a series (the memory working set) in buckets 2 % wide: its quantiles.
CREATE TABLE IF NOT EXISTS rank_histogram (
    run_id  TEXT   NOT NULL,
    node    TEXT   NOT NULL,
    rank    BIGINT NOT NULL,
    series  TEXT   NOT NULL,
    bucket  BIGINT NOT NULL, -- holds values in (1.02^(bucket-1), 1.02^bucket]
    n       BIGINT NOT NULL,
    last_ms BIGINT NOT NULL, -- the latest sample counted (retention)
    PRIMARY KEY (run_id, node, rank, series, bucket)
);

-- The report written into an ended run, once, by the replica that billed it.
ALTER TABLE run_bills ADD COLUMN report TEXT; -- 'written', or why it could not be
