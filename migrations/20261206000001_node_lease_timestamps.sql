-- Handover by time as well as by step: the node series' latest sample time, and the time a new
-- reporter's samples must come after (its predecessor's latest), so the series never goes back
-- in time when the new reporter's first batch holds samples measured before the handover.
ALTER TABLE node_leases ADD COLUMN last_timestamp BIGINT NOT NULL DEFAULT -1; -- unix ms, -1 if none
ALTER TABLE node_leases ADD COLUMN covered_until BIGINT NOT NULL DEFAULT -1;  -- unix ms, -1 if none
