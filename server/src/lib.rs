//! mlscope-proxy: an MLflow-compatible reverse proxy, built in three floors that look only down,
//! one folder each:
//!
//! - `plumbing/` knows no capability and no configuration file: forwarding (`proxy`), the typed
//!   MLflow client (`mlflow`), the state store (`store`), the one error type (`error`), telemetry,
//!   request classes, identities, credentials, how write bodies are read (`writes`), settings.
//! - `capabilities/` is what mlscope adds to MLflow: the metric routes (`metric_routes`, with the
//!   scope contract in `rewrite`, node deduplication in `dedup` and the run's write queue in
//!   `coalesce`), the artifact gateway (`artifacts`), run health and the GPU bill (`health`), the
//!   fair share (`fairshare`) and the authorizer every capability that acts for a client asks
//!   (`authz`). A capability imports plumbing, and another capability only through a seam named in
//!   `shell::floors::SEAMS`.
//! - `shell/` composes them: the configuration (`config`), the components built (`state`), the
//!   route table and the run until shutdown (`app`), the listeners (`serve`), the admin endpoints
//!   (`admin`) and a tool off the request path (`relocate`).
//!
//! A module's floor is its folder; `shell::floors` checks every path in the code against it, so a
//! module that imports above its floor fails the tests. `docs/architecture.md` draws the floors
//! and the seams.
//!
//! Every component owns its settings: one `*Options` struct in its module (a flag, its
//! environment variable and a key of the config file per field), turned into its settings with
//! its own defaults and checked by its own `validate`.
//!
//! Modules another crate of the workspace uses (the binary, the integration tests, the load
//! tests) are `pub`; every other module is `pub(crate)`, and the `unreachable_pub` lint keeps
//! items inside them from claiming more.

pub mod capabilities;
pub mod plumbing;
pub mod shell;
