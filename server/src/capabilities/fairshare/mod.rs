//! Fair share of MLflow among clients, so that no client's writes starve the others':
//!
//! - **per-client buckets**: writes (requests) and samples (metrics, params and tags) per second
//!   per client, by token bucket. A write is admitted while its client's buckets are not empty and
//!   charged what it carried once answered (a log-batch's weight is known only once its body was
//!   read), so a heavy batch goes through and its client waits for the next one;
//! - **per-team quotas** from the configuration file: a team's members share the team's buckets,
//!   on top of their own;
//! - **saturation control** ([`governor`]): how many writes MLflow takes at once is learned from
//!   the latency of the light writes beside them; once that many are at MLflow, a writer taking
//!   more than its share of them (what the other writers leave, at least an equal split) and
//!   writing more than twice the others is refused first.
//!   The only writer is never refused by it, nor writers writing alike, nor anyone while MLflow has
//!   room.
//!
//! A writer that saturation control holds back **waits its turn** first: its write waits (its body
//! unread) until a write at MLflow is answered and the governor admits it, for at most
//! `TURN_WAIT`, so the capacity the other writers leave goes to it and a client that ignores
//! `Retry-After` does not spin. At most `MAX_WAITING_PER_CLIENT` writes of one client and
//! `MAX_WAITING` in all wait; beyond, and after `TURN_WAIT`, the write is refused.
//!
//! A refusal is 429 with `Retry-After` and MLflow's `REQUEST_LIMIT_EXCEEDED`, which MLflow's
//! client retries; nothing of a refused write reaches MLflow, and its body is read (up to a bound)
//! before the answer so the client's keep-alive connection stays usable. Reads (GET, searches,
//! GraphQL) are never refused here and do not count: a reader does not shrink a writer's share.
//! Artifact uploads have their own share (upload slots), not this one.
//!
//! A client is its credential (`crate::plumbing::credential::Credential`, keyed on what MLflow decodes, not
//! on its spelling) once MLflow authenticated that credential (answered a request to its tracking
//! API, which requires authentication, with a success or a client error other than 401 and 403;
//! never `/health`, `/version` or the proxy's own answers), else its address. Without MLflow
//! authentication every credential is accepted, so a user name is only a claim there: a client can
//! then spend another user's or team's share by naming it, and escape its own by inventing names.

mod bucket;
mod governor;
mod metrics;

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::Request;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::{header, StatusCode};
use http_body::{Body as _, Frame, SizeHint};
use serde::Deserialize;

use crate::plumbing::after;
use crate::plumbing::client::TrustedProxies;
use crate::plumbing::credential::Credential;
use crate::plumbing::error::Error;
use crate::plumbing::route::RouteClass;
use crate::plumbing::telemetry::Metrics;

use crate::plumbing::aged::AgedMap;
use bucket::{Bucket, Rate};
use governor::{Governor, Verdict};
use metrics::FairShareMetrics;

/// Clients remembered at once; beyond, the least recently seen is forgotten (full buckets again).
const MAX_CLIENTS: usize = 50_000;
/// Credentials remembered as authenticated by MLflow; beyond, the least recently seen is
/// forgotten (charged to its address until MLflow authenticates it again).
const MAX_VERIFIED: usize = 100_000;
/// Buckets hold this many seconds of their rate.
const BURST_SECONDS: f64 = 2.0;
/// Longest a write held back by saturation control waits for its turn before it is refused.
const TURN_WAIT: Duration = Duration::from_secs(2);
/// How often a waiting write looks whether nothing is at MLflow (then no answer comes to wake it).
const TURN_RECHECK: Duration = Duration::from_millis(100);
/// Writes of one client waiting for their turn at once; beyond, refused at once.
const MAX_WAITING_PER_CLIENT: usize = 64;
/// Writes of all clients waiting for their turn at once; beyond, refused at once.
const MAX_WAITING: usize = 4096;

use crate::plumbing::writes::WriteWeight;

/// The share's settings.
#[derive(Debug, Clone, PartialEq)]
pub struct FairShareConfig {
    /// Writes per second one client may send (bursts of two seconds' worth); 0: no limit.
    pub client_write_rate: f64,
    /// Samples (metrics, params, tags) per second one client may write; 0: no limit.
    pub client_sample_rate: f64,
    /// Ceiling of the learned number of writes at MLflow at once; 0 turns saturation control off.
    pub max_writes_at_mlflow: usize,
    /// Quotas of teams, from the configuration file.
    pub teams: Vec<Team>,
}

impl Default for FairShareConfig {
    fn default() -> Self {
        Self {
            client_write_rate: 1000.0,
            client_sample_rate: 20_000.0,
            max_writes_at_mlflow: 64,
            teams: Vec::new(),
        }
    }
}

/// A team's quota: what its members may write together, per second.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Team {
    pub name: String,
    /// MLflow user names (of Basic credentials).
    pub users: Vec<String>,
    /// Writes per second of all members together; 0: no limit.
    #[serde(default)]
    pub write_rate: f64,
    /// Samples per second of all members together; 0: no limit.
    #[serde(default)]
    pub sample_rate: f64,
}

impl FairShareConfig {
    pub fn validate(&self) -> Result<(), String> {
        let rate_ok = |r: f64| r >= 0.0 && r.is_finite();
        for (name, rate) in [
            ("client-write-rate", self.client_write_rate),
            ("client-sample-rate", self.client_sample_rate),
        ] {
            if !rate_ok(rate) {
                return Err(format!(
                    "{name} must be 0 (off) or a positive number per second, not {rate}"
                ));
            }
        }
        let mut names = HashSet::new();
        let mut members = HashMap::new();
        for team in &self.teams {
            if team.name.is_empty() || team.name.len() > 64 {
                return Err("a team's name must be 1 to 64 characters".into());
            }
            if !names.insert(team.name.as_str()) {
                return Err(format!("team {:?} is named twice", team.name));
            }
            if !rate_ok(team.write_rate) || !rate_ok(team.sample_rate) {
                return Err(format!(
                    "team {:?}: write_rate and sample_rate must be 0 (off) or positive",
                    team.name
                ));
            }
            for user in &team.users {
                if let Some(other) = members.insert(user.as_str(), team.name.as_str()) {
                    return Err(format!(
                        "user {user:?} is a member of teams {other:?} and {:?}; a user belongs to one team",
                        team.name
                    ));
                }
            }
        }
        Ok(())
    }
}

/// The share's settings as given (see [`crate::plumbing::settings`]); `None`: not given here.
#[derive(Debug, Clone, Default, clap::Args, Deserialize)]
pub(crate) struct FairShareOptions {
    /// Writes to MLflow's tracking API per second one client (its credential once MLflow
    /// accepted it, else its address) may send, with bursts of two seconds' worth; beyond, 429
    /// with Retry-After, which MLflow's client retries; 0 turns the limit off [default: 1000].
    #[arg(long, env = "MLSCOPE_CLIENT_WRITE_RATE", value_name = "PER_SECOND")]
    pub client_write_rate: Option<f64>,
    /// Metrics, params and tags per second one client may write, with bursts of two seconds'
    /// worth; a batch is charged once answered, so its client's next write waits until the bucket
    /// has paid for it; 0 turns the limit off [default: 20000].
    #[arg(long, env = "MLSCOPE_CLIENT_SAMPLE_RATE", value_name = "PER_SECOND")]
    pub client_sample_rate: Option<f64>,
    /// Ceiling of the number of writes at MLflow at once, a limit learned from MLflow's latency:
    /// once that many are at MLflow, a client writing more than its share and twice the others is
    /// refused (429); the only writer never is; 0 turns saturation control off [default: 64].
    #[arg(long, env = "MLSCOPE_MAX_WRITES_AT_MLFLOW", value_name = "N")]
    pub max_writes_at_mlflow: Option<usize>,
    /// Per-team quotas (`[[teams]]` tables): only in the file.
    #[arg(skip)]
    pub teams: Option<Vec<Team>>,
}

impl FairShareOptions {
    /// The given values over the defaults.
    pub(crate) fn resolve(self) -> FairShareConfig {
        let d = FairShareConfig::default();
        FairShareConfig {
            client_write_rate: self.client_write_rate.unwrap_or(d.client_write_rate),
            client_sample_rate: self.client_sample_rate.unwrap_or(d.client_sample_rate),
            max_writes_at_mlflow: self.max_writes_at_mlflow.unwrap_or(d.max_writes_at_mlflow),
            teams: self.teams.unwrap_or(d.teams),
        }
    }
}

/// Who a write is charged to.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum ClientKey {
    Credential([u8; 16]),
    Address(IpAddr),
}

/// One client's buckets.
struct ClientShare {
    writes: Option<Bucket>,
    samples: Option<Bucket>,
}

struct TeamShare {
    writes: Option<(Rate, Bucket)>,
    samples: Option<(Rate, Bucket)>,
}

struct Shares {
    clients: AgedMap<ClientKey, ClientShare>,
    verified: AgedMap<[u8; 16], ()>,
    teams: Vec<TeamShare>,
}

/// Why a write was refused: a label of `mlscope_fair_share_writes_total` and the client's message.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Refusal {
    ClientRate(Duration),
    ClientSamples(Duration),
    TeamRate(Duration),
    TeamSamples(Duration),
    Saturation { limit: usize, writers: usize },
}

impl Refusal {
    fn reason(self) -> &'static str {
        match self {
            Refusal::ClientRate(_) => "client_rate",
            Refusal::ClientSamples(_) => "client_samples",
            Refusal::TeamRate(_) => "team_rate",
            Refusal::TeamSamples(_) => "team_samples",
            Refusal::Saturation { .. } => "saturation",
        }
    }

    fn wait(self) -> Duration {
        match self {
            Refusal::ClientRate(w)
            | Refusal::ClientSamples(w)
            | Refusal::TeamRate(w)
            | Refusal::TeamSamples(w) => w,
            Refusal::Saturation { .. } => Duration::from_secs(1),
        }
    }
}

/// The share: buckets per client and team, and the saturation governor.
pub struct FairShare {
    config: FairShareConfig,
    write_rate: Option<Rate>,
    sample_rate: Option<Rate>,
    team_of: HashMap<String, usize>,
    trusted: TrustedProxies,
    shares: Mutex<Shares>,
    governor: Option<Mutex<Governor<ClientKey>>>,
    /// Woken once per write MLflow answered: a waiting write may have its turn.
    turn: tokio::sync::Notify,
    /// Writes waiting for their turn: in all, and per client (at most `MAX_WAITING` entries).
    waiting: Mutex<(usize, HashMap<ClientKey, usize>)>,
    metrics: FairShareMetrics,
}

impl FairShare {
    /// `None` when every part of the share is off.
    pub fn new(
        config: &FairShareConfig,
        trusted: TrustedProxies,
        metrics: Metrics,
    ) -> Option<Arc<FairShare>> {
        // Registered on or off, so `/metrics` names the same families either way.
        let metrics = FairShareMetrics::new(&metrics);
        let now = Instant::now();
        let team_rate = |per_second: f64, min_burst: f64| {
            Rate::new(per_second, BURST_SECONDS, min_burst).map(|r| (r, Bucket::full(r, now)))
        };
        let teams: Vec<TeamShare> = config
            .teams
            .iter()
            .map(|t| TeamShare {
                writes: team_rate(t.write_rate, 1.0),
                samples: team_rate(t.sample_rate, 1.0),
            })
            .collect();
        let share = FairShare {
            write_rate: Rate::new(config.client_write_rate, BURST_SECONDS, 1.0),
            sample_rate: Rate::new(config.client_sample_rate, BURST_SECONDS, 1.0),
            team_of: config
                .teams
                .iter()
                .enumerate()
                .flat_map(|(i, t)| t.users.iter().map(move |u| (u.clone(), i)))
                .collect(),
            trusted,
            shares: Mutex::new(Shares {
                clients: AgedMap::new(MAX_CLIENTS),
                verified: AgedMap::new(MAX_VERIFIED),
                teams,
            }),
            governor: (config.max_writes_at_mlflow > 0)
                .then(|| Mutex::new(Governor::new(config.max_writes_at_mlflow, now))),
            turn: tokio::sync::Notify::new(),
            waiting: Mutex::new((0, HashMap::new())),
            metrics,
            config: config.clone(),
        };
        let off = share.write_rate.is_none()
            && share.sample_rate.is_none()
            && share.governor.is_none()
            && config.teams.is_empty();
        (!off).then(|| Arc::new(share))
    }

    /// Who `credential` from `address` is charged to, and its team.
    fn key(&self, credential: Option<&Credential>, address: IpAddr) -> (ClientKey, Option<usize>) {
        if let Some(credential) = credential {
            let mut shares = self.shares.lock().expect("fair share lock");
            if shares.verified.get_mut(&credential.digest).is_some() {
                let team = credential
                    .user
                    .as_deref()
                    .and_then(|u| self.team_of.get(u).copied());
                return (ClientKey::Credential(credential.digest), team);
            }
        }
        (ClientKey::Address(address), None)
    }

    /// MLflow itself answered a request to `path` carrying `credential` with `status`: the
    /// credential is authenticated when the path is one MLflow authenticates and the answer says it
    /// did.
    fn learn(&self, credential: &Credential, path: &str, status: StatusCode) {
        if !authenticated(path, status) {
            return;
        }
        let mut shares = self.shares.lock().expect("fair share lock");
        shares
            .verified
            .get_or_insert_with(&credential.digest, || ());
    }

    /// Admits a write of `client` at `now`, taking one write from its buckets, or says why not.
    fn admit(&self, client: &ClientKey, team: Option<usize>, now: Instant) -> Result<(), Refusal> {
        let mut shares = self.shares.lock().expect("fair share lock");
        let Shares { clients, teams, .. } = &mut *shares;
        let (write_rate, sample_rate) = (self.write_rate, self.sample_rate);
        let own = clients.get_or_insert_with(client, || ClientShare {
            writes: write_rate.map(|r| Bucket::full(r, now)),
            samples: sample_rate.map(|r| Bucket::full(r, now)),
        });
        if let (Some(rate), Some(bucket)) = (write_rate, own.writes.as_mut()) {
            bucket.check(rate, 1.0, now).map_err(Refusal::ClientRate)?;
        }
        if let (Some(rate), Some(bucket)) = (sample_rate, own.samples.as_mut()) {
            bucket
                .check(rate, 1.0, now)
                .map_err(Refusal::ClientSamples)?;
        }
        if let Some(team) = team.and_then(|t| teams.get_mut(t)) {
            if let Some((rate, bucket)) = team.writes.as_mut() {
                bucket.check(*rate, 1.0, now).map_err(Refusal::TeamRate)?;
            }
            if let Some((rate, bucket)) = team.samples.as_mut() {
                bucket
                    .check(*rate, 1.0, now)
                    .map_err(Refusal::TeamSamples)?;
            }
        }
        if let Some(governor) = &self.governor {
            let mut governor = governor.lock().expect("governor lock");
            if let Verdict::Heaviest { limit, writers } = governor.admit(client, now) {
                return Err(Refusal::Saturation { limit, writers });
            }
        }
        if let (Some(rate), Some(bucket)) = (write_rate, own.writes.as_mut()) {
            bucket.charge(rate, 1.0, now);
        }
        if let Some((rate, bucket)) = team
            .and_then(|t| teams.get_mut(t))
            .and_then(|t| t.writes.as_mut())
        {
            bucket.charge(*rate, 1.0, now);
        }
        Ok(())
    }

    /// An admitted write's whole body of `bytes` was handed on at `now`: it is at MLflow.
    fn forwarded(&self, write: &WriteState, client: &ClientKey, bytes: u64, now: Instant) {
        let Some(governor) = &self.governor else {
            return;
        };
        let mut governor = governor.lock().expect("governor lock");
        // Under the governor's lock, so that an answer racing the body's end counts once.
        if write
            .phase
            .compare_exchange(UPLOADING, AT_MLFLOW, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            let _ = write.forwarded_at.set(now);
            governor.forwarded(client, bytes, now);
            self.metrics.load(governor.limit(), governor.at_mlflow());
        }
    }

    /// An admitted write of `bytes` was answered (`by_mlflow`: by MLflow itself; `None`:
    /// abandoned), weighing `samples`.
    ///
    /// `credit` is whom MLflow's answer counts for in saturation control: the client itself, or
    /// the credential MLflow authenticated with this very answer (a job's first write, made
    /// while its credential was still charged to its address, is the job's: its address must not
    /// linger as another writer beside it).
    #[allow(clippy::too_many_arguments)]
    fn answered(
        &self,
        write: &WriteState,
        client: &ClientKey,
        credit: &ClientKey,
        team: Option<usize>,
        bytes: u64,
        samples: usize,
        by_mlflow: Option<bool>,
    ) {
        let now = Instant::now();
        if let Some(governor) = &self.governor {
            let mut governor = governor.lock().expect("governor lock");
            if write.phase.swap(ANSWERED, Ordering::AcqRel) == AT_MLFLOW {
                // MLflow's time only: from the whole body handed on to MLflow's answer.
                let latency = by_mlflow
                    .filter(|by| *by)
                    .and(write.forwarded_at.get())
                    .map(|at| now.saturating_duration_since(*at));
                governor.answered(client, credit, bytes, latency, samples, now);
                self.metrics.load(governor.limit(), governor.at_mlflow());
                self.turn.notify_one();
            }
        }
        let mut shares = self.shares.lock().expect("fair share lock");
        let Shares { clients, teams, .. } = &mut *shares;
        if let (Some(rate), Some(bucket)) = (
            self.sample_rate,
            clients.peek_mut(client).and_then(|c| c.samples.as_mut()),
        ) {
            bucket.charge(rate, samples as f64, now);
        }
        if let Some((rate, bucket)) = team
            .and_then(|t| teams.get_mut(t))
            .and_then(|t| t.samples.as_mut())
        {
            bucket.charge(*rate, samples as f64, now);
        }
    }

    /// Admits a write of `client`, waiting for its turn when saturation control holds it back
    /// (see the module's documentation), or says why not.
    async fn admit_in_turn(&self, client: &ClientKey, team: Option<usize>) -> Result<(), Refusal> {
        let refusal = match self.admit(client, team, Instant::now()) {
            Err(refusal @ Refusal::Saturation { .. }) => refusal,
            other => return other,
        };
        let Some(_place) = Waiting::join(self, client) else {
            return Err(refusal);
        };
        self.metrics
            .write("waited", "saturation", self.team_name(team));
        let deadline = tokio::time::Instant::now() + TURN_WAIT;
        let mut look = false;
        loop {
            let woken = self.turn.notified();
            tokio::pin!(woken);
            // Registered before looking, so that an answer between the look and the wait wakes it.
            woken.as_mut().enable();
            let now = tokio::time::Instant::now();
            if look || now >= deadline {
                match self.admit(client, team, Instant::now()) {
                    Err(refusal @ Refusal::Saturation { .. }) if now >= deadline => {
                        return Err(refusal)
                    }
                    Err(Refusal::Saturation { .. }) => {}
                    other => return other,
                }
            }
            // One answer wakes one waiting write: one goes in as one comes out, never a herd of
            // them at once. Without an answer, it looks again only when nothing is at MLflow (no
            // answer is coming) or its wait is over.
            let answered = tokio::time::timeout_at(deadline.min(now + TURN_RECHECK), woken)
                .await
                .is_ok();
            look = answered || self.nothing_at_mlflow();
        }
    }

    /// Whether no write is at MLflow now.
    fn nothing_at_mlflow(&self) -> bool {
        self.governor
            .as_ref()
            .is_none_or(|g| g.lock().expect("governor lock").at_mlflow() == 0)
    }

    fn team_name(&self, team: Option<usize>) -> Option<&str> {
        team.and_then(|t| self.config.teams.get(t))
            .map(|t| t.name.as_str())
    }

    fn refuse(&self, refusal: Refusal, team: Option<usize>) -> Response {
        self.metrics
            .write("refused", refusal.reason(), self.team_name(team));
        let wait = refusal.wait().as_secs_f64();
        let team_name = self.team_name(team).unwrap_or_default();
        let message = match refusal {
            Refusal::ClientRate(_) => format!(
                "this client is sending more than the {} writes per second one client may send through mlscope-proxy; retry after {wait:.1} s",
                self.config.client_write_rate
            ),
            Refusal::ClientSamples(_) => format!(
                "this client is writing more than the {} metrics, params and tags per second one client may write through mlscope-proxy; retry after {wait:.1} s",
                self.config.client_sample_rate
            ),
            Refusal::TeamRate(_) => format!(
                "team {team_name:?} is using all of its writes per second (its quota in mlscope-proxy's configuration); retry after {wait:.1} s"
            ),
            Refusal::TeamSamples(_) => format!(
                "team {team_name:?} is using all of its samples per second (its quota in mlscope-proxy's configuration); retry after {wait:.1} s"
            ),
            Refusal::Saturation { limit, writers } => format!(
                "MLflow is taking as many writes at once as it can without slowing the other clients' light writes (about {limit}, learned from their latency), shared by {writers} writing clients, and this client has what the others leave of them and writes more than twice the others; retry after 1 s, or send fewer writes at once"
            ),
        };
        Error::OverShare {
            message,
            retry_after: wait.ceil().max(1.0) as u64,
        }
        .into_response()
    }
}

/// A write's place among those waiting for their turn; given up when dropped (also when the
/// client goes away while it waits).
struct Waiting<'a> {
    share: &'a FairShare,
    client: ClientKey,
}

impl<'a> Waiting<'a> {
    /// A place for a write of `client`, or `None` when as many as allowed already wait.
    fn join(share: &'a FairShare, client: &ClientKey) -> Option<Waiting<'a>> {
        let mut guard = share.waiting.lock().expect("waiting lock");
        let (total, per_client) = &mut *guard;
        let own = per_client.get(client).copied().unwrap_or(0);
        if *total >= MAX_WAITING || own >= MAX_WAITING_PER_CLIENT {
            return None;
        }
        *total += 1;
        *per_client.entry(client.clone()).or_insert(0) += 1;
        Some(Waiting {
            share,
            client: client.clone(),
        })
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        let mut guard = self.share.waiting.lock().expect("waiting lock");
        let (total, per_client) = &mut *guard;
        *total = total.saturating_sub(1);
        if let Some(n) = per_client.get_mut(&self.client) {
            *n -= 1;
            if *n == 0 {
                per_client.remove(&self.client);
            }
        }
    }
}

/// Whether the share governs this request: a write to MLflow's tracking API (artifact uploads
/// have upload slots of their own).
fn governs(request: &Request) -> bool {
    let path = request.uri().path();
    crate::plumbing::route::is_write(request.method(), path)
        && !matches!(RouteClass::of(path), RouteClass::Artifacts)
}

/// Where an admitted write is: its body still arriving, at MLflow (handed on whole), answered.
const UPLOADING: u8 = 0;
const AT_MLFLOW: u8 = 1;
const ANSWERED: u8 = 2;

/// One admitted write's progress, shared by its body (which says when it was handed on whole) and
/// the layer (which sees the answer).
#[derive(Default)]
struct WriteState {
    phase: AtomicU8,
    forwarded_at: OnceLock<Instant>,
}

/// Counts an admitted write until it is answered, also when the client goes away first.
struct Admitted {
    share: Arc<FairShare>,
    write: Arc<WriteState>,
    client: ClientKey,
    team: Option<usize>,
    bytes: u64,
    done: bool,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        if !self.done {
            self.share.answered(
                &self.write,
                &self.client,
                &self.client,
                self.team,
                self.bytes,
                0,
                None,
            );
        }
    }
}

/// An admitted write's body: tells the share when it has been read to its end (handed on whole
/// to MLflow, or read whole by an interceptor that sends it on), the moment from which the write
/// is MLflow's work.
struct Watched {
    inner: Body,
    share: Arc<FairShare>,
    write: Arc<WriteState>,
    client: ClientKey,
    bytes: u64,
}

impl Watched {
    fn ended(&self) {
        self.share
            .forwarded(&self.write, &self.client, self.bytes, Instant::now());
    }
}

impl http_body::Body for Watched {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(None) => self.ended(),
            Poll::Ready(Some(Ok(_))) if self.inner.is_end_stream() => self.ended(),
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// What a request body weighs for the governor before it is read: its declared length, at most
/// 64 MiB (a body without one, chunked, counts as 1 KiB). Bounded, so no declared length can
/// overflow a client's sums.
fn declared_bytes(request: &Request) -> u64 {
    request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(1024)
        .min(64 << 20)
}

/// Whether MLflow's own answer `status` to `path` says it authenticated the request's
/// credential: its tracking API (which MLflow's authentication guards; `/health`, `/version`,
/// static files and `server-info` it answers to anyone) answered with a success or a client
/// error other than 401, 403 and 407.
fn authenticated(path: &str, status: StatusCode) -> bool {
    let api = crate::plumbing::route::TRACKING_PREFIXES
        .iter()
        .any(|prefix| path.starts_with(prefix));
    let open = path.ends_with("/server-info") || path.contains("/static");
    let refused = matches!(
        status,
        StatusCode::UNAUTHORIZED
            | StatusCode::FORBIDDEN
            | StatusCode::PROXY_AUTHENTICATION_REQUIRED
    );
    api && !open && !refused && (status.is_success() || status.is_client_error())
}

/// The step on every route (`shell::app` composes the steps): writes admitted or refused by the
/// share, credentials learned from MLflow's answers.
pub(crate) async fn admit<F, R>(share: &Arc<FairShare>, request: Request, next: F) -> Response
where
    F: FnOnce(Request) -> R,
    R: std::future::Future<Output = Response>,
{
    let credential = Credential::of(request.headers());
    let path = credential
        .is_some()
        .then(|| request.uri().path().to_owned());
    let response = if governs(&request) {
        // Reads count for nobody's share: who sent one is worked out only for writes.
        let peer = crate::plumbing::client::peer_of(request.extensions()).ip();
        let address = share.trusted.client(peer, request.headers());
        let (client, team) = share.key(credential.as_ref(), address);
        let bytes = declared_bytes(&request);
        if let Err(refusal) = share.admit_in_turn(&client, team).await {
            let refused = share.refuse(refusal, team);
            return crate::plumbing::error::refuse_unread(request.into_body(), refused).await;
        }
        share
            .metrics
            .write("admitted", "none", share.team_name(team));
        let write = Arc::new(WriteState::default());
        if request.body().is_end_stream() {
            share.forwarded(&write, &client, bytes, Instant::now());
        }
        let request = request.map(|inner| {
            Body::new(Watched {
                inner,
                share: share.clone(),
                write: write.clone(),
                client: client.clone(),
                bytes,
            })
        });
        let mut admitted = Admitted {
            share: share.clone(),
            write,
            client,
            team,
            bytes,
            done: false,
        };
        let mut response = next(request).await;
        let weight = response
            .extensions()
            .get::<WriteWeight>()
            .map_or(1, |w| w.0.max(1));
        admitted.done = true;
        let (status, by_mlflow) = (response.status(), answered_by_mlflow(&response));
        // Counted once the answer has gone (the client does not wait for it).
        let share = share.clone();
        after::defer(&mut response, move || {
            // Learned before the answer is counted, so that it counts for the credential MLflow
            // authenticated with it.
            learn(
                &share,
                credential.as_ref(),
                path.as_deref(),
                by_mlflow,
                status,
            );
            let credit = share.key(credential.as_ref(), address).0;
            share.answered(
                &admitted.write,
                &admitted.client,
                &credit,
                team,
                bytes,
                weight,
                // MLflow's answer, or the coalescer's success for a write it sent with others.
                Some(by_mlflow || status.is_success()),
            );
        });
        response
    } else {
        let mut response = next(request).await;
        if credential.is_some() {
            let (status, by_mlflow) = (response.status(), answered_by_mlflow(&response));
            let share = share.clone();
            after::defer(&mut response, move || {
                learn(
                    &share,
                    credential.as_ref(),
                    path.as_deref(),
                    by_mlflow,
                    status,
                );
            });
        }
        response
    };
    response
}

/// What MLflow's answer (`by_mlflow`) with `status` to `path` says of `credential`. Only MLflow's
/// own answer says whether it authenticated the credential (the proxy's refusals, before MLflow
/// saw the request, say nothing about it).
fn learn(
    share: &FairShare,
    credential: Option<&Credential>,
    path: Option<&str>,
    by_mlflow: bool,
    status: StatusCode,
) {
    if let (Some(credential), Some(path), true) = (credential, path, by_mlflow) {
        share.learn(credential, path, status);
    }
}

fn answered_by_mlflow(response: &Response) -> bool {
    response
        .extensions()
        .get::<crate::plumbing::proxy::AnsweredBy>()
        .is_some_and(|a| *a == crate::plumbing::proxy::AnsweredBy::UPSTREAM)
}

#[cfg(test)]
mod tests;
