-- Artifact uploads the store refused, counted per run. Replicas share the count; the run's tags
-- (mlscope.artifacts.*) show the latest values.
CREATE TABLE IF NOT EXISTS artifact_upload_failures (
    run_id      TEXT   PRIMARY KEY NOT NULL,
    failures    BIGINT NOT NULL,
    last_error  TEXT   NOT NULL,
    last_path   TEXT   NOT NULL,
    updated_at  BIGINT NOT NULL -- unix milliseconds
);
