//! Credentials, plumbing every floor may use: secrets from the command line or environment (never
//! shown), the `Authorization` header a service credential sends to MLflow, the credential a
//! client's request carries, and the fingerprint of everything that identifies a client (the
//! key of caches of MLflow's answers per client).

use std::fmt;

use http::{header, HeaderMap, HeaderName, HeaderValue};
use sha2::{Digest, Sha256};

/// A credential from the command line or environment; never shown in debug output.
#[derive(Clone)]
pub struct Secret(String);

impl Secret {
    pub(crate) fn expose(&self) -> &str {
        &self.0
    }
}

impl From<String> for Secret {
    fn from(value: String) -> Self {
        Secret(value)
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(***)")
    }
}

/// A credential the proxy itself uses with MLflow (the stale-run sweep, `relocate`).
#[derive(Debug, Clone)]
pub enum ServiceCredential {
    None,
    Token(Secret),
    Basic { username: String, password: Secret },
}

impl ServiceCredential {
    /// The `Authorization` value it sends (`Bearer`, or `Basic` of `user:password`); `None`
    /// without a credential or when it holds characters a header cannot carry.
    pub fn header(&self) -> Option<HeaderValue> {
        use base64::Engine as _;
        let value = match self {
            ServiceCredential::None => return None,
            ServiceCredential::Token(token) => format!("Bearer {}", token.expose()),
            ServiceCredential::Basic { username, password } => format!(
                "Basic {}",
                base64::engine::general_purpose::STANDARD
                    .encode(format!("{username}:{}", password.expose()))
            ),
        };
        HeaderValue::from_str(&value).ok()
    }
}

/// The credential a request carries in `Authorization` (Basic or Bearer), as MLflow reads it: the
/// scheme in any case and the value trimmed, as werkzeug parses them, a Basic credential decoded to
/// its user and password; the digest is of what was decoded, so every spelling of one credential is
/// one credential. Two requests with the same user and another password are two credentials: a
/// client that does not know a user's password cannot spend that user's share.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Credential {
    pub user: Option<Box<str>>,
    pub digest: [u8; 16],
}

impl Credential {
    /// `None` without an `Authorization` header of scheme Basic or Bearer that MLflow could read.
    pub(crate) fn of(headers: &HeaderMap) -> Option<Credential> {
        let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?.trim();
        // werkzeug: `scheme, _, rest = value.partition(" ")`, the scheme lowered, rest stripped.
        let (scheme, rest) = value.split_once(|c: char| c.is_ascii_whitespace())?;
        let rest = rest.trim();
        let mut hash = Sha256::new();
        let user = if scheme.eq_ignore_ascii_case("basic") {
            use base64::Engine as _;
            // Python's b64decode (werkzeug's) drops characters outside the alphabet.
            let alphabet: String = rest
                .chars()
                .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '/' | '='))
                .collect();
            let raw = base64::engine::general_purpose::STANDARD
                .decode(alphabet.as_bytes())
                .ok()?;
            let text = String::from_utf8(raw).ok().filter(|t| !t.is_empty())?;
            hash.update(b"basic\0");
            hash.update(text.as_bytes());
            // werkzeug: `username, _, password = decoded.partition(":")`.
            Some(
                text.split_once(':')
                    .map_or(text.as_str(), |(u, _)| u)
                    .into(),
            )
        } else if scheme.eq_ignore_ascii_case("bearer") {
            if rest.is_empty() {
                return None;
            }
            hash.update(b"bearer\0");
            hash.update(rest.as_bytes());
            None
        } else {
            return None;
        };
        let mut digest = [0u8; 16];
        digest.copy_from_slice(&hash.finalize()[..16]);
        Some(Credential { user, digest })
    }
}

/// Headers that describe the request's body or its transfer, not the client.
static BODY_HEADERS: [HeaderName; 10] = [
    header::CONTENT_LENGTH,
    header::CONTENT_TYPE,
    header::CONTENT_ENCODING,
    header::RANGE,
    header::IF_MATCH,
    header::IF_NONE_MATCH,
    header::IF_MODIFIED_SINCE,
    header::IF_UNMODIFIED_SINCE,
    header::IF_RANGE,
    header::ACCEPT_ENCODING,
];

/// Headers that change from request to request of one client and carry no credential: left out
/// of the cache key, so one client's requests share its cached answers.
static REQUEST_SPECIFIC: [HeaderName; 8] = [
    HeaderName::from_static("x-request-id"),
    HeaderName::from_static("x-forwarded-for"),
    HeaderName::from_static("x-forwarded-proto"),
    HeaderName::from_static("x-forwarded-host"),
    HeaderName::from_static("traceparent"),
    HeaderName::from_static("tracestate"),
    header::USER_AGENT,
    header::ACCEPT,
];

/// The headers that describe a request, its body or its transfer, not its client: left out of a
/// fingerprint, and of the authorizer's probes.
pub(crate) fn not_identifying(name: &HeaderName) -> bool {
    REQUEST_SPECIFIC.contains(name) || BODY_HEADERS.contains(name)
}

/// Everything a client sends that could identify it to MLflow or its auth plugin, hashed: every
/// header except those that only describe the request or its body. An unknown header is part of
/// the key, so a plugin's own credential header is never shared between clients.
pub(crate) fn fingerprint(client: &HeaderMap) -> [u8; 32] {
    let mut pairs: Vec<(&str, &[u8])> = client
        .iter()
        .filter(|(name, _)| {
            !REQUEST_SPECIFIC.contains(name) && !BODY_HEADERS.contains(name) && !is_hop_by_hop(name)
        })
        .map(|(name, value)| (name.as_str(), value.as_bytes()))
        .collect();
    pairs.sort();
    let mut hash = Sha256::new();
    for (name, value) in pairs {
        hash.update((name.len() as u64).to_le_bytes());
        hash.update(name.as_bytes());
        hash.update((value.len() as u64).to_le_bytes());
        hash.update(value);
    }
    hash.finalize().into()
}

fn is_hop_by_hop(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
            | "expect"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        pairs
            .iter()
            .map(|(k, v)| (HeaderName::from_static(k), HeaderValue::from_static(v)))
            .collect()
    }

    #[test]
    fn every_spelling_of_one_credential_is_one_credential_and_another_password_another() {
        let of = |value: &'static str| Credential::of(&headers(&[("authorization", value)]));
        // alice:secret
        let alice = of("Basic YWxpY2U6c2VjcmV0").unwrap();
        assert_eq!(alice.user.as_deref(), Some("alice"));
        for spelling in [
            "basic YWxpY2U6c2VjcmV0",
            "BASIC YWxpY2U6c2VjcmV0",
            "Basic    YWxpY2U6c2VjcmV0   ",
            "  bAsIc YWxpY2U6c2VjcmV0",
        ] {
            assert_eq!(of(spelling), Some(alice.clone()), "{spelling}");
        }
        // alice:guess
        assert_ne!(of("Basic YWxpY2U6Z3Vlc3M=").unwrap(), alice);
        assert_eq!(of("Bearer abc"), of("bearer   abc "));
        assert_ne!(of("Bearer abc"), of("Bearer abd"));
        assert_eq!(of("Bearer abc").unwrap().user, None);
        assert_eq!(of("Negotiate abc"), None);
        assert_eq!(of("Basic %%%"), None);
    }

    #[test]
    fn credentials_never_show_in_debug_output() {
        assert_eq!(format!("{:?}", Secret("hunter2".into())), "Secret(***)");
    }

    #[test]
    fn service_credentials_send_bearer_or_basic() {
        let basic = ServiceCredential::Basic {
            username: "alice".into(),
            password: Secret::from("x".to_owned()),
        };
        assert_eq!(basic.header().unwrap(), "Basic YWxpY2U6eA==");
        let token = ServiceCredential::Token(Secret::from("t0k".to_owned()));
        assert_eq!(token.header().unwrap(), "Bearer t0k");
        assert_eq!(ServiceCredential::None.header(), None);
        let broken = ServiceCredential::Token(Secret::from("a\nb".to_owned()));
        assert_eq!(broken.header(), None);
    }

    #[test]
    fn fingerprints_differ_per_credential_and_ignore_request_specific_headers() {
        let alice = headers(&[
            ("authorization", "Basic YWxpY2U6eA=="),
            ("x-request-id", "1"),
            ("content-length", "5"),
        ]);
        let alice_again = headers(&[
            ("authorization", "Basic YWxpY2U6eA=="),
            ("x-request-id", "2"),
            ("user-agent", "mlflow"),
        ]);
        let bob = headers(&[("authorization", "Basic Ym9iOng=")]);
        let anonymous = headers(&[]);
        let plugin_key = headers(&[("x-api-key", "k1")]);
        let other_plugin_key = headers(&[("x-api-key", "k2")]);
        assert_eq!(fingerprint(&alice), fingerprint(&alice_again));
        assert_ne!(fingerprint(&alice), fingerprint(&bob));
        assert_ne!(fingerprint(&alice), fingerprint(&anonymous));
        assert_ne!(fingerprint(&plugin_key), fingerprint(&other_plugin_key));
    }
}
