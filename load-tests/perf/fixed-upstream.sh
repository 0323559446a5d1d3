# Sourced by the scripts beside it: `fixed_upstream_conf WORK NAME` writes WORK/NAME.conf, an nginx
# that answers every request on 127.0.0.1:18080 with the same MLflow run (the upstream of the
# profiles: it costs the same for every build), its pid and error log under WORK.
fixed_upstream_conf() {
  cat >"$1/$2.conf" <<CONF
worker_processes 1;
daemon off;
pid $1/$2.pid;
error_log $1/$2-error.log;
events { worker_connections 64; }
http {
  access_log off;
  server {
    listen 127.0.0.1:18080;
    location / { default_type application/json; return 200 '{"run":{"info":{"run_id":"r1","status":"RUNNING"},"data":{}}}'; }
  }
}
CONF
}
