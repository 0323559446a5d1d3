-- The MLflow workspace a run's heartbeats came in (their X-MLFLOW-WORKSPACE header; NULL for the
-- default workspace or an MLflow without workspaces): MLflow finds a run only in its own
-- workspace, so the stale-run sweep looks the run up, tags and ends it there.
ALTER TABLE run_ranks ADD COLUMN workspace TEXT;
