-- A bill MLflow will never let mlscope write (the run was deleted, or garbage-collected): marked
-- done with the reason here instead of being retried for as long as the row is kept.
ALTER TABLE run_bills ADD COLUMN failure TEXT;

-- A billed run its client resumed (runs/update RUNNING, accepted by MLflow): back in the sweep
-- (stale detection, gauges, the idle-GPU tag); its first bill stands.
ALTER TABLE run_bills ADD COLUMN reopened_ms BIGINT;
