//! Fair share of MLflow among clients: writes admitted per client by a token bucket, so that one
//! client flooding MLflow with writes is refused (429, `Retry-After`, MLflow's
//! `REQUEST_LIMIT_EXCEEDED`, which MLflow's client retries) before it slows everyone else.
//!
//! A client is its MLflow user (the Basic credential's user name, or a Bearer token, hashed),
//! else its address (see `crate::client`). Off unless `--client-write-rate` is set.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{ConnectInfo, Request, State};
use axum::middleware::Next;
use axum::response::Response;
use http::{header, HeaderMap, HeaderValue, StatusCode};
use sha2::{Digest, Sha256};

use crate::client::TrustedProxies;
use crate::error::mlflow_error;
use crate::telemetry::Metrics;

/// Clients remembered at once; beyond, the longest idle is forgotten (a full bucket again).
const MAX_CLIENTS: usize = 50_000;

/// Who a request is, for its share.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ClientKey {
    User(String),
    Token([u8; 16]),
    Address(IpAddr),
}

impl ClientKey {
    pub fn of(headers: &HeaderMap, peer: IpAddr, trusted: &TrustedProxies) -> ClientKey {
        let authorization = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .map(str::trim);
        if let Some(basic) = authorization.and_then(|a| a.strip_prefix("Basic ")) {
            use base64::Engine as _;
            if let Some(user) = base64::engine::general_purpose::STANDARD
                .decode(basic.trim())
                .ok()
                .and_then(|raw| String::from_utf8(raw).ok())
                .and_then(|text| text.split_once(':').map(|(user, _)| user.to_owned()))
            {
                return ClientKey::User(user);
            }
        }
        if let Some(token) = authorization.and_then(|a| a.strip_prefix("Bearer ")) {
            let digest = Sha256::digest(token.trim().as_bytes());
            let mut key = [0u8; 16];
            key.copy_from_slice(&digest[..16]);
            return ClientKey::Token(key);
        }
        ClientKey::Address(trusted.client(peer, headers))
    }
}

struct Bucket {
    tokens: f64,
    updated: Instant,
}

/// Token buckets per client: `rate` writes per second, `burst` at once.
pub struct FairShare {
    rate: f64,
    burst: f64,
    trusted: TrustedProxies,
    buckets: Mutex<HashMap<ClientKey, Bucket>>,
    metrics: Metrics,
}

impl FairShare {
    /// `None` when `rate` is 0 (off).
    pub fn new(rate: f64, trusted: TrustedProxies, metrics: Metrics) -> Option<Arc<FairShare>> {
        (rate > 0.0).then(|| {
            Arc::new(FairShare {
                rate,
                burst: (2.0 * rate).max(1.0),
                trusted,
                buckets: Mutex::new(HashMap::new()),
                metrics,
            })
        })
    }

    /// Takes one write for `client` at `now`; `Err(wait)` when its bucket is empty.
    pub fn take(&self, client: ClientKey, now: Instant) -> Result<(), Duration> {
        let mut buckets = self.buckets.lock().expect("fair share lock");
        if buckets.len() >= MAX_CLIENTS && !buckets.contains_key(&client) {
            if let Some(idle) = buckets
                .iter()
                .min_by_key(|(_, b)| b.updated)
                .map(|(k, _)| k.clone())
            {
                buckets.remove(&idle);
            }
        }
        let bucket = buckets.entry(client).or_insert(Bucket {
            tokens: self.burst,
            updated: now,
        });
        let elapsed = now.saturating_duration_since(bucket.updated).as_secs_f64();
        bucket.tokens = (bucket.tokens + elapsed * self.rate).min(self.burst);
        bucket.updated = now;
        if bucket.tokens >= 1.0 {
            bucket.tokens -= 1.0;
            Ok(())
        } else {
            Err(Duration::from_secs_f64((1.0 - bucket.tokens) / self.rate))
        }
    }
}

/// The layer on the write routes: a write beyond its client's share is answered 429.
pub async fn admit(State(share): State<Arc<FairShare>>, request: Request, next: Next) -> Response {
    let peer = request
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map_or(IpAddr::from([0, 0, 0, 0]), |c| c.0.ip());
    let client = ClientKey::of(request.headers(), peer, &share.trusted);
    match share.take(client, Instant::now()) {
        Ok(()) => {
            share.metrics.fair_share("admitted");
            next.run(request).await
        }
        Err(wait) => {
            share.metrics.fair_share("refused");
            let mut answer = mlflow_error(
                StatusCode::TOO_MANY_REQUESTS,
                "REQUEST_LIMIT_EXCEEDED",
                &format!(
                    "this client is writing faster than the {} writes per second one client may send through mlscope-proxy; retry after {:.1} s.",
                    share.rate,
                    wait.as_secs_f64()
                ),
            );
            let seconds = wait.as_secs_f64().ceil().max(1.0) as u64;
            if let Ok(value) = HeaderValue::from_str(&seconds.to_string()) {
                answer.headers_mut().insert(header::RETRY_AFTER, value);
            }
            answer
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        pairs
            .iter()
            .map(|(k, v)| (k.parse().unwrap(), v.parse().unwrap()))
            .collect()
    }

    #[test]
    fn a_client_is_its_user_its_token_or_its_address() {
        let peer: IpAddr = "10.1.2.3".parse().unwrap();
        let none = TrustedProxies::default();
        // alice:secret and alice:other are one user.
        let alice = ClientKey::of(
            &headers(&[("authorization", "Basic YWxpY2U6c2VjcmV0")]),
            peer,
            &none,
        );
        let alice_again = ClientKey::of(
            &headers(&[("authorization", "Basic YWxpY2U6b3RoZXI=")]),
            peer,
            &none,
        );
        assert_eq!(alice, ClientKey::User("alice".into()));
        assert_eq!(alice, alice_again);
        let token = ClientKey::of(&headers(&[("authorization", "Bearer abc")]), peer, &none);
        assert!(matches!(token, ClientKey::Token(_)));
        assert_ne!(
            token,
            ClientKey::of(&headers(&[("authorization", "Bearer abd")]), peer, &none)
        );
        assert_eq!(
            ClientKey::of(&HeaderMap::new(), peer, &none),
            ClientKey::Address(peer)
        );
    }

    #[test]
    fn a_bucket_admits_its_burst_then_its_rate_and_clients_do_not_share() {
        let share = FairShare::new(10.0, TrustedProxies::default(), Metrics::new()).unwrap();
        let start = Instant::now();
        let flood = ClientKey::User("flood".into());
        for _ in 0..20 {
            share.take(flood.clone(), start).unwrap();
        }
        let wait = share.take(flood.clone(), start).unwrap_err();
        assert!(
            wait > Duration::ZERO && wait <= Duration::from_millis(100),
            "{wait:?}"
        );
        // Another client is untouched; the flood gets one more per 100 ms.
        share.take(ClientKey::User("calm".into()), start).unwrap();
        share
            .take(flood.clone(), start + Duration::from_millis(100))
            .unwrap();
        assert!(share
            .take(flood, start + Duration::from_millis(100))
            .is_err());
        assert!(FairShare::new(0.0, TrustedProxies::default(), Metrics::new()).is_none());
    }
}
