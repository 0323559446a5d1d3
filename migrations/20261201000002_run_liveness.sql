-- Liveness from every write, and outcomes that a rank's own later samples supersede.
-- last_write_ms: the latest write MLflow accepted for the run through the proxy (any metric, not
--   only system samples), copied onto each of the run's rows; the sweep does not judge a run
--   lost or failed while it is still being written to.
-- last_sample_ms: the latest system sample of this (node, rank); a sample well after the rank's
--   reported end (a restarted rank, or an end reported by someone else) clears that end.
ALTER TABLE run_ranks ADD COLUMN last_write_ms BIGINT;
ALTER TABLE run_ranks ADD COLUMN last_sample_ms BIGINT;
