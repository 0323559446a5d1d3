-- What a run's collectors reported about what the run stood on: its declared data changing under
-- it, the processes a rank left running, how they were ended, and GPU memory still held after
-- them. One row per report as heard (a report sent again is the same row); the newest 64 rows of
-- a run are kept. Timestamps are unix milliseconds on the hearing proxy's clock.
CREATE TABLE IF NOT EXISTS run_findings (
    run_id   TEXT   NOT NULL,
    node     TEXT   NOT NULL, -- '' when the sender named no node
    rank     BIGINT NOT NULL, -- -1 when the sender named no rank
    kind     TEXT   NOT NULL, -- data_changed, leftover_processes, leftovers_ended, gpu_memory_left
    subject  TEXT   NOT NULL, -- data_changed: the data's name; gpu_memory_left: the GPU index
    detail   TEXT   NOT NULL, -- the tag's value, at most 500 characters
    heard_ms BIGINT NOT NULL,
    PRIMARY KEY (run_id, node, rank, kind, subject, detail)
);
CREATE INDEX IF NOT EXISTS run_findings_heard ON run_findings (heard_ms);
