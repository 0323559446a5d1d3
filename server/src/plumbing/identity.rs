//! Who sends a metrics request, as the collector (or a platform SDK) declares it: the identity
//! headers of the metric scope contract (`X-Mlscope-Node`, `X-Mlscope-Rank`). The metric routes
//! scope and deduplicate by it, the coalescer keeps it out of its merge key, run health takes a
//! rank's end only from that rank's own identity.

use http::HeaderMap;
use mlscope_scopes::Identity;

/// Headers through which the collector (or a platform SDK) says who is sending.
pub(crate) const NODE_HEADER: &str = "x-mlscope-node";
pub(crate) const RANK_HEADER: &str = "x-mlscope-rank";

/// The identity request headers declare; parts that are absent or malformed stay unknown.
pub(crate) fn identity_from_headers(headers: &HeaderMap) -> Identity {
    let text = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
            .filter(|v| !v.is_empty())
    };
    Identity {
        // Any spelling of a node name (upper case, `_`) names the same node as its contract
        // form; names that are not names at all stay unknown.
        node: text(NODE_HEADER)
            .filter(|n| {
                n.len() <= 253
                    && n.bytes()
                        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_'))
            })
            .map(mlscope_scopes::normalize_node),
        rank: text(RANK_HEADER).and_then(|r| r.parse().ok()),
    }
}
