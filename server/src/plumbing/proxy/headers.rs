//! Header handling between client and upstream: hop-by-hop removal (RFC 9110 §7.6.1), the
//! `Host` policy, `X-Forwarded-*` and request ids.

use std::net::SocketAddr;

use http::header::{self, HeaderMap, HeaderName, HeaderValue};

use super::HostHeader;

pub static X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
static X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
static X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");

/// Connection-specific headers that a proxy must not forward, besides those `Connection` names.
/// `Expect` is answered by this proxy's own server (it sends `100 Continue` when the body is
/// first read), so it is not passed on either.
const HOP_BY_HOP: [HeaderName; 7] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

/// Removes hop-by-hop headers: the fixed list and every header the `Connection` header names.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // Most heads carry none of them: one pass over the names present decides, where removing
    // each name of the list hashed and looked up each: about 800 instructions a forwarded
    // request, both heads together.
    if !headers.keys().any(|name| HOP_BY_HOP.contains(name)) {
        return;
    }
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|token| HeaderName::from_bytes(token.trim().as_bytes()).ok())
        .collect();
    for name in named.iter().chain(HOP_BY_HOP.iter()) {
        headers.remove(name);
    }
}

/// A request id: the client's own when it sent a sane one, else a fresh UUID.
pub fn request_id(headers: &HeaderMap) -> HeaderValue {
    headers
        .get(&X_REQUEST_ID)
        .filter(|v| !v.is_empty() && v.len() <= 128 && v.to_str().is_ok())
        .cloned()
        .unwrap_or_else(new_request_id)
}

/// A new request id: a version-4 UUID whose random bits come from a generator each thread seeds
/// once from the system's randomness. Ids are for finding a request's lines, not secrets, and
/// asking the kernel for randomness on every request was a system call on its path.
fn new_request_id() -> HeaderValue {
    thread_local! {
        static STATE: std::cell::Cell<u64> = std::cell::Cell::new(uuid::Uuid::new_v4().as_u64_pair().0);
    }
    let (high, low) = STATE.with(|state| (split_mix(state), split_mix(state)));
    let bits = (u128::from(high) << 64 | u128::from(low)).to_le_bytes();
    let id = uuid::Builder::from_random_bytes(bits).into_uuid();
    let mut text = [0u8; uuid::fmt::Hyphenated::LENGTH];
    HeaderValue::from_str(id.hyphenated().encode_lower(&mut text))
        .expect("a UUID is a valid header value")
}

/// SplitMix64: the next of a sequence that visits every 64-bit value once.
fn split_mix(state: &std::cell::Cell<u64>) -> u64 {
    let next = state.get().wrapping_add(0x9E37_79B9_7F4A_7C15);
    state.set(next);
    let mut z = next;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The `Host` header that names the upstream: its host, and its port where it is not 80. The
/// host and port only: never user information written in the upstream's URL.
pub(crate) fn upstream_host(upstream: &http::uri::Authority) -> HeaderValue {
    let host = match upstream.port_u16() {
        Some(port) if port != 80 => format!("{}:{port}", upstream.host()),
        _ => upstream.host().to_owned(),
    };
    HeaderValue::from_str(&host).expect("an authority's host and port are a valid header value")
}

/// Prepares a client request's headers for the upstream; `upstream_host` is
/// [`upstream_host`]'s value for it.
pub(crate) fn to_upstream(
    headers: &mut HeaderMap,
    peer: SocketAddr,
    request_authority: Option<&http::uri::Authority>,
    host_policy: HostHeader,
    upstream_host: &HeaderValue,
    request_id: &HeaderValue,
) {
    strip_hop_by_hop(headers);
    headers.remove(header::EXPECT);

    // HTTP/2 clients send `:authority` instead of `Host`; keep the client's view in both cases.
    let authority_host = || request_authority.and_then(|a| HeaderValue::from_str(a.as_str()).ok());
    match host_policy {
        HostHeader::Preserve => {
            if !headers.contains_key(header::HOST) {
                if let Some(host) = authority_host() {
                    headers.insert(header::HOST, host);
                }
            }
        }
        HostHeader::Upstream => {
            let client_host = headers.get(header::HOST).cloned().or_else(authority_host);
            headers.insert(header::HOST, upstream_host.clone());
            if let Some(host) = client_host {
                if !headers.contains_key(&X_FORWARDED_HOST) {
                    headers.insert(X_FORWARDED_HOST.clone(), host);
                }
            }
        }
    }

    // Append the peer to any chain a gateway in front of us started.
    let forwarded_for = match headers.get(&X_FORWARDED_FOR).and_then(|v| v.to_str().ok()) {
        Some(chain) if !chain.trim().is_empty() => {
            HeaderValue::try_from(format!("{chain}, {}", peer.ip())).ok()
        }
        _ => Some(address_value(peer.ip())),
    };
    if let Some(value) = forwarded_for {
        headers.insert(X_FORWARDED_FOR.clone(), value);
    }
    // A gateway that terminated TLS already said `https`; only fill in what is missing.
    if !headers.contains_key(&X_FORWARDED_PROTO) {
        headers.insert(X_FORWARDED_PROTO.clone(), HeaderValue::from_static("http"));
    }
    headers.insert(X_REQUEST_ID.clone(), request_id.clone());
}

/// An address as a header value. The last one made on this thread is kept: a connection's
/// requests all come from its one peer, and formatting an address is most of the cost.
fn address_value(address: std::net::IpAddr) -> HeaderValue {
    thread_local! {
        static LAST: std::cell::RefCell<Option<(std::net::IpAddr, HeaderValue)>> =
            const { std::cell::RefCell::new(None) };
    }
    LAST.with_borrow_mut(|last| match last {
        Some((kept, value)) if *kept == address => value.clone(),
        _ => {
            let value = HeaderValue::try_from(address.to_string())
                .expect("an IP address is a valid header value");
            *last = Some((address, value.clone()));
            value
        }
    })
}

/// Whether a message's content type is JSON (`application/json`, any parameters).
pub fn is_json(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|mime| mime.trim().eq_ignore_ascii_case("application/json"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (k, v) in pairs {
            map.append(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        map
    }

    #[test]
    fn hop_by_hop_headers_and_those_named_by_connection_are_removed() {
        let mut h = headers(&[
            ("connection", "keep-alive, X-Secret-Hop"),
            ("x-secret-hop", "1"),
            ("keep-alive", "timeout=5"),
            ("transfer-encoding", "chunked"),
            ("te", "trailers"),
            ("upgrade", "h2c"),
            ("authorization", "Bearer t"),
            ("content-type", "application/json"),
        ]);
        strip_hop_by_hop(&mut h);
        let mut left: Vec<_> = h.keys().map(|k| k.as_str()).collect();
        left.sort();
        assert_eq!(left, ["authorization", "content-type"]);
    }

    #[test]
    fn host_is_preserved_and_forwarded_chain_extended() {
        let mut h = headers(&[
            ("host", "mlflow.example:443"),
            ("x-forwarded-for", "10.0.0.1"),
            ("x-forwarded-proto", "https"),
            ("expect", "100-continue"),
        ]);
        let upstream = upstream_host(&"127.0.0.1:5000".parse().unwrap());
        let id = HeaderValue::from_static("req-1");
        to_upstream(
            &mut h,
            "192.0.2.7:5555".parse().unwrap(),
            None,
            HostHeader::Preserve,
            &upstream,
            &id,
        );
        assert_eq!(h["host"], "mlflow.example:443");
        assert_eq!(h["x-forwarded-for"], "10.0.0.1, 192.0.2.7");
        assert_eq!(h["x-forwarded-proto"], "https");
        assert_eq!(h["x-request-id"], "req-1");
        assert!(!h.contains_key("expect"));

        let mut h = headers(&[("host", "gateway:80")]);
        to_upstream(
            &mut h,
            "127.0.0.1:1".parse().unwrap(),
            None,
            HostHeader::Upstream,
            &upstream,
            &id,
        );
        assert_eq!(h["host"], "127.0.0.1:5000");
        assert_eq!(h["x-forwarded-host"], "gateway:80");
        assert_eq!(h["x-forwarded-proto"], "http");

        // User information in the upstream's URL never reaches a header, nor port 80.
        for (authority, host) in [
            ("user:secret@mlflow:5000", "mlflow:5000"),
            ("mlflow", "mlflow"),
            ("mlflow:80", "mlflow"),
            ("[::1]:5000", "[::1]:5000"),
        ] {
            let upstream = upstream_host(&authority.parse().unwrap());
            let mut h = headers(&[("host", "gateway:80")]);
            let peer = "127.0.0.1:1".parse().unwrap();
            to_upstream(&mut h, peer, None, HostHeader::Upstream, &upstream, &id);
            assert_eq!(h["host"], host, "{authority}");
        }
    }

    /// Each request names its own peer, whichever peer the thread's previous request had, and
    /// a request without a chain gets the peer alone.
    #[test]
    fn each_request_names_its_own_peer() {
        let upstream = upstream_host(&"127.0.0.1:5000".parse().unwrap());
        let id = HeaderValue::from_static("req-1");
        let peers = [
            "192.0.2.7:1",
            "192.0.2.7:2",
            "[2001:db8::1]:3",
            "192.0.2.8:4",
            "192.0.2.7:5",
        ];
        for peer in peers {
            let mut h = headers(&[("host", "gateway:80")]);
            let peer: SocketAddr = peer.parse().unwrap();
            to_upstream(&mut h, peer, None, HostHeader::Preserve, &upstream, &id);
            assert_eq!(h["x-forwarded-for"], peer.ip().to_string().as_str());
            assert_eq!(h.get_all("host").iter().count(), 1);
        }
        // An HTTP/2 request's authority becomes its Host.
        let mut h = HeaderMap::new();
        let authority: http::uri::Authority = "mlflow.example".parse().unwrap();
        let peer = "192.0.2.7:1".parse().unwrap();
        to_upstream(
            &mut h,
            peer,
            Some(&authority),
            HostHeader::Preserve,
            &upstream,
            &id,
        );
        assert_eq!(h["host"], "mlflow.example");
    }

    #[test]
    fn request_ids_are_kept_when_sane_and_generated_otherwise() {
        assert_eq!(request_id(&headers(&[("x-request-id", "abc")])), "abc");
        let long = "x".repeat(200);
        assert_ne!(
            request_id(&headers(&[("x-request-id", &long)])),
            long.as_str()
        );
        assert_eq!(request_id(&HeaderMap::new()).len(), 36);
    }

    /// New ids are version-4 UUIDs, different on every request and on every thread.
    #[test]
    fn new_request_ids_are_uuids_and_never_repeat() {
        let made = |n: usize| -> Vec<String> {
            (0..n)
                .map(|_| request_id(&HeaderMap::new()).to_str().unwrap().to_owned())
                .collect()
        };
        let mut ids = made(10_000);
        let others: Vec<_> = (0..4)
            .map(|_| std::thread::spawn(move || made(1_000)))
            .collect();
        for other in others {
            ids.extend(other.join().unwrap());
        }
        for id in &ids {
            let uuid = uuid::Uuid::parse_str(id).unwrap();
            assert_eq!(uuid.get_version_num(), 4, "{id}");
            assert_eq!(uuid.get_variant(), uuid::Variant::RFC4122, "{id}");
        }
        let count = ids.len();
        ids.sort();
        ids.dedup();
        assert_eq!(ids.len(), count);
    }
}
