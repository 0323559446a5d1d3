-- Every proxy process that shares this store registers itself here at startup and refreshes
-- last_seen_at, so an operator can see which replicas share the state and /readyz proves the
-- store accepts writes.
CREATE TABLE IF NOT EXISTS proxy_replicas (
    replica_id   TEXT PRIMARY KEY NOT NULL,
    version      TEXT NOT NULL,
    started_at   BIGINT NOT NULL, -- unix milliseconds
    last_seen_at BIGINT NOT NULL  -- unix milliseconds
);
