-- A bill MLflow will never let mlscope write (the run was deleted, or garbage-collected): marked
-- done with the reason here instead of being retried for as long as the row is kept.
ALTER TABLE run_bills ADD COLUMN failure TEXT;
