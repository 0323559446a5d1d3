-- What a rank's collector judged GPU idleness on (its tag mlscope/rank-<r>/gpu_idle_basis):
-- sm_active (GPM's SM activity), utilization (NVML's utilisation and memory activity) or mixed
-- (its GPUs differ). NULL: not said (a collector from before GPM, or none): utilization.
ALTER TABLE run_ranks ADD COLUMN gpu_idle_basis TEXT;
