-- One reporting rank per (run, node) for node-wide system metrics (node_*, rootfs_*).
-- The reporter keeps its seat while it renews; after failover_timeout without renewal the next
-- rank that sends takes over with an atomic compare-and-set on this row.
CREATE TABLE IF NOT EXISTS node_leases (
    run_id        TEXT   NOT NULL,
    node          TEXT   NOT NULL,
    reporter_rank BIGINT NOT NULL,
    epoch         BIGINT NOT NULL, -- +1 at every election: renewals of a deposed reporter fail
    renewed_at    BIGINT NOT NULL, -- unix ms, the renewing proxy's receive clock
    step_offset   BIGINT NOT NULL, -- added to the reporter's steps so the node series never goes back
    last_step     BIGINT NOT NULL, -- highest node-series step written (after offset), -1 if none
    PRIMARY KEY (run_id, node)
);
